#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_capture_streams_gpu.py tests/test_capture_streams.py tests/test_graphs_gpu.py tests/test_full_iteration_gpu.py > $OUT/tests-after-review.txt 2>&1
echo "rc=$? $(tail -1 $OUT/tests-after-review.txt)"; grep -E "^FAILED|Error" $OUT/tests-after-review.txt | head
