#!/bin/bash
# Call after the review (one H200): the GPU files the change and its review touch, then a third
# alternating timing round (small; the same command as time.sh).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
for f in test_optimizer_graph_gpu test_gradient_homes_gpu test_capture_streams_gpu test_segment_graphs_gpu test_graphs_gpu; do
  PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -m "not cpu_only" tests/$f.py >> $OUT/tests.txt 2>&1
done
B="--config small --systems ours_layer_graphs ours_layer_and_optimizer_graphs ours_full_iteration --warmup 5 --steps 40"
for tree in .before .; do name=$( [ $tree = . ] && echo after || echo before )3
  (cd $tree && PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/t-$name)
  cp /tmp/t-$name/results-gpt.md $OUT/time-$name.md
done
