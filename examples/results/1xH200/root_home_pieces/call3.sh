#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
start=$(date +%s)
git log -1 --format='%H %s' > $OUT/info.txt 2>/dev/null
PYTHONPATH=$PWD:$PWD/tests timeout 200 python3 .probe/towers_mutation.py > $OUT/towers_mutation.txt 2>&1; grep MUTATION $OUT/towers_mutation.txt | cut -c1-300
PYTHONPATH=$PWD:$PWD/tests timeout 240 python3 .probe/size1_pieces.py > $OUT/size1_pieces.txt 2>&1; grep -E "^(PASS|FAIL)" $OUT/size1_pieces.txt | cut -c1-600
NPROC=1 QUEUE="$QUEUE" DEADLINE=$((${DEADLINE:-400} - $(date +%s) + start)) bash .gpu/session2.sh
left=$((${TOTAL:-560} - $(date +%s) + start)); echo "left for bench: $left"
[ $left -gt 150 ] && T=$((left / 2 - 10)) CONFIGS=small S="fsdp2_eager ours_layer_graphs ours_segment_graphs" bash .gpu/bench1.sh
