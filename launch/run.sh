#!/usr/bin/env bash
# Single-node launcher around torchrun.
#
#   launch/run.sh [--nproc-per-node N] [other torchrun flags] script.py [script args...]
#
# N defaults to the number of GPUs, or 2 when there is none (CPU, gloo).
# Everything else goes to torchrun unchanged (torchrun flags before the script); a
# --nproc-per-node given after other torchrun flags also works (torchrun keeps the last).
set -euo pipefail

if [[ $# -eq 0 ]]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi

nproc=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node|--nproc_per_node) nproc="${2:?$1 needs a value}"; shift 2 ;;
    --nproc-per-node=*|--nproc_per_node=*) nproc="${1#*=}"; shift ;;
    *) args=("$@"); break ;;  # the first other argument: it and the rest go to torchrun as they are
  esac
done

if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ "$nproc" -gt 0 ]]; then
    :
  else
    nproc=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  fi
  [[ "$nproc" -gt 0 ]] || nproc=2
fi

exec python -m torch.distributed.run --standalone --nproc-per-node "$nproc" "${args[@]}"
