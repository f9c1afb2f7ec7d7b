#!/bin/bash
# Host time per replay (--hot-path) before (.before: 7e43a97) and after the backward probe, alternating.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
run() {  # $1: tree, $2: name
  (cd $1 && PYTHONPATH=$PWD timeout 120 torchrun --standalone --nproc-per-node 2 examples/benchmark.py \
     --config small medium --systems ours_layer_graphs ours_segment_graphs --hot-path --out /tmp/$2) > /tmp/$2.log 2>&1
  echo "$2 rc=$?"; mkdir -p $OUT/$2; cp /tmp/$2/results-gpt.md $OUT/$2/ 2>/dev/null
}
run .before before-1; run . after-1; run .before before-2; run . after-2
for d in before-1 after-1 before-2 after-2; do echo "== $d"; grep -E "^\| (small|medium) \||graph (forward|backward)|^Host time" $OUT/$d/results-gpt.md | cut -c1-100; done
