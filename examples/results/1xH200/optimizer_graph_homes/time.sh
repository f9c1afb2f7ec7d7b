#!/bin/bash
# Alternating before/after timing: per-layer graphs with and without the optimizer graph, small.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
B="--config small --systems ours_layer_graphs ours_layer_and_optimizer_graphs ours_full_iteration --warmup 5 --steps 40"
for round in 1 2; do for tree in .before .; do name=$( [ $tree = . ] && echo after || echo before )$round
  (cd $tree && PYTHONPATH=$PWD timeout 120 torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/t-$name) > /tmp/t-$name.log 2>&1
  echo "time $name rc=$?"; cp /tmp/t-$name/results-gpt.md $OUT/time-$name.md; grep -E "^\| small \|" /tmp/t-$name/results-gpt.md | cut -d'|' -f2-5,8
done; done
