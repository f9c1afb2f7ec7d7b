#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cp tests/test_capture_thread_gpu.py .before/tests/
(cd .before && PYTHONPATH=$PWD timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_capture_thread_gpu.py > $OUT/thread-test-before.txt 2>&1; echo "thread test on before rc=$? $(tail -1 $OUT/thread-test-before.txt)")
B="--config small medium --systems ours_layer_graphs ours_segment_graphs ours_full_iteration --warmup 5 --steps 30"
for round in 1 2; do for tree in .before .; do name=$( [ $tree = . ] && echo after || echo before )$round
  (cd $tree && PYTHONPATH=$PWD timeout 120 torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/t-$name) > /tmp/t-$name.log 2>&1
  echo "time $name rc=$?"; cp /tmp/t-$name/results-gpt.md $OUT/time-$name.md; grep -E "^\| (small|medium) \|" /tmp/t-$name/results-gpt.md | cut -d'|' -f2-5
done; done
