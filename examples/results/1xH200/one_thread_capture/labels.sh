#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_capture_thread_gpu.py > $OUT/thread-test.txt 2>&1; echo "thread test rc=$? $(tail -1 $OUT/thread-test.txt)"
PYTHONPATH=$PWD timeout 200 torchrun --standalone --nproc-per-node 1 examples/benchmark.py --config small --systems fsdp2_eager ours_layer_graphs ours_segment_graphs ours_full_iteration --memory --warmup 5 --steps 20 --out /tmp/m > /tmp/m.log 2>&1
echo "bench rc=$?"; cp /tmp/m/results-gpt.md $OUT/memory-labels.md; grep -E "backward|other graphs|autograd" /tmp/m/results-gpt.md | head -20
