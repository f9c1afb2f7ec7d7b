#!/bin/bash
# Call 1 (one H200): the GPU tests of the change, then the benchmark from the tree before (.before, a
# `git archive` of 21ed96b with this change's examples/benchmark.py, which adds the system) and after.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
for f in test_optimizer_graph_gpu test_gradient_homes_gpu; do
  PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -m "not cpu_only" tests/$f.py >> $OUT/tests.txt 2>&1
done
B="--config small medium --systems fsdp2_eager ours_layer_graphs ours_layer_and_optimizer_graphs
   ours_segment_and_optimizer_graphs ours_full_iteration --memory --warmup 5 --steps 20"
for tree in .before .; do name=$( [ $tree = . ] && echo after || echo before )
  (cd $tree && PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/bench-$name)
  cp /tmp/bench-$name/results-gpt.md $OUT/bench-$name.md
done
