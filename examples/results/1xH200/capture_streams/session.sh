#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c "import torch; s=[torch.cuda.Stream() for _ in range(33)]; print('torch pool wraps: 1st == 33rd stream:', s[0].cuda_stream == s[32].cuda_stream, torch.__version__)" | tee $OUT/pool_wraps.txt
FILES="test_capture_streams_gpu test_capture_thread_gpu test_graphs_gpu test_segment_graphs_gpu test_full_iteration_gpu test_optimizer_graph_gpu test_chained_buffers_gpu test_gradient_homes_gpu test_replay_stream_gpu test_gpu test_stream_order_gpu test_activation_offload_graphs_gpu test_unused_params_gpu" REST=1 LIMIT=500 bash .gpu/t1.sh
