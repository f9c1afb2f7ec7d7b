#!/bin/bash
# Benchmark before (.before = main) and after, one process each, --memory.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
B="--config ${CONFIGS:-small medium} --systems ${SYSTEMS:-fsdp2_eager fsdp2_full_graph ours_eager ours_layer_graphs ours_segment_graphs ours_full_iteration} --memory --warmup 5 --steps 20"
for tree in ${TREES:-.before .}; do name=$( [ $tree = . ] && echo after || echo before )
  (cd $tree && PYTHONPATH=$PWD timeout ${T:-280} torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/bench-$name) > /tmp/bench-$name.log 2>&1
  echo "bench $name rc=$?"; cp /tmp/bench-$name/results-gpt.md $OUT/results-$name.md; cp /tmp/bench-$name/results-gpt.json $OUT/results-$name.json
  cp /tmp/bench-$name.log $OUT/bench-$name.log
  grep -v "Warning\|warn" /tmp/bench-$name.log | tail -3
done
