#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
B="--config small medium --systems fsdp2_eager ours_layer_graphs --memory --warmup 5 --steps 10"
PYTHONPATH=$PWD timeout 200 torchrun --standalone --nproc-per-node 1 examples/benchmark.py $B --out /tmp/h-with > /tmp/h-with.log 2>&1; echo "with rc=$?"
PYTHONPATH=$PWD timeout 200 torchrun --standalone --nproc-per-node 1 examples/results/1xH200/optimizer_graph_homes/no_root_home.py $B --out /tmp/h-without > /tmp/h-without.log 2>&1; echo "without rc=$?"
cp /tmp/h-with/results-gpt.md $OUT/root-home-with.md; cp /tmp/h-without/results-gpt.md $OUT/root-home-without.md
tail -5 /tmp/h-without.log
grep -E "^\| (small|medium) \|" $OUT/root-home-*.md | cut -d'|' -f1-3,8
