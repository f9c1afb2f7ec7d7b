#!/usr/bin/env bash
# Multi-node training with Slurm: one torchrun agent per node, one worker per GPU.
#
#   sbatch launch/slurm_multinode.sh examples/train_gpt.py --config medium --steps 200
#
# Adjust the #SBATCH lines (and partition/account) to your cluster.
#SBATCH --job-name=fsdp_graph
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}  # keep equal to --gpus-per-node
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)

# Optional NCCL settings (see DESIGN.md, "Pitfalls"):
# export NCCL_NVLS_ENABLE=0     # NVLink SHARP / multicast off
# export NCCL_GRAPH_REGISTER=0  # no graph buffer registration (with expandable_segments)

# srun starts one torchrun per node; the c10d rendezvous on the head node joins them.
srun python -m torch.distributed.run \
  --nnodes "$SLURM_NNODES" \
  --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$head:29500" \
  --rdzv-id "$SLURM_JOB_ID" \
  "$@"
