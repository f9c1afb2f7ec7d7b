#!/bin/bash
# Tests: the capture-thread test first, then the one-GPU suite files that capture, then world1_rest (HF, bitwise).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
start=$(date +%s); LIMIT=${LIMIT:-570}
for f in ${FILES:-test_capture_thread_gpu test_graphs_gpu test_segment_graphs_gpu test_full_iteration_gpu test_chained_buffers_gpu test_optimizer_graph_gpu test_gradient_homes_gpu test_replay_stream_gpu test_gpu test_unused_params_gpu test_stream_order_gpu test_activation_offload_graphs_gpu test_activation_offload_gpu test_graph_parity_gpu}; do
  left=$((start + LIMIT - $(date +%s))); [ $left -lt 25 ] && { echo "not run: $f"; continue; }
  PYTHONPATH=$PWD timeout $left python3 -m pytest -q -p no:cacheprovider -m "not cpu_only" tests/$f.py > /tmp/$f.txt 2>&1
  echo "$f rc=$? $(tail -1 /tmp/$f.txt)"; grep -E "^FAILED|Error:" /tmp/$f.txt | head -5
  cat /tmp/$f.txt >> $OUT/tests.txt
done
left=$((start + LIMIT + 15 - $(date +%s)))
[ -n "$REST" ] && [ $left -gt 60 ] && { PYTHONPATH=$PWD:$PWD/tests timeout $left python .probe/world1_rest.py > $OUT/world1_rest.txt 2>&1; echo "world1_rest rc=$?"; grep -E "^PASS|^FAIL" $OUT/world1_rest.txt; }
true
