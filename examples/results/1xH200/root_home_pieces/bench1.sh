#!/bin/bash
# One GPU: the size-1 NCCL probe, then before (.before) / after benchmark of $S on $CONFIGS, twice each in turn.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
git log -1 --format='%H %s' > $OUT/info.txt 2>/dev/null
if [ -n "$PROBE" ]; then PYTHONPATH=$PWD:$PWD/tests timeout 300 python3 .probe/size1_pieces.py > $OUT/size1_pieces.txt 2>&1; grep -E "^(PASS|FAIL)" $OUT/size1_pieces.txt; fi
S=${S:-"fsdp2_eager ours_layer_graphs ours_segment_graphs"}
run() {  # $1: tree, $2: name
  (cd $1 && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD timeout ${T:-150} torchrun --standalone --nproc-per-node ${NPROC:-1} examples/benchmark.py \
     --config ${CONFIGS:-small medium} --systems $S --warmup 4 --steps 12 --out /tmp/$2) > $OUT/bench-$2.log 2>&1
  echo "$2 rc=$?" >> $OUT/bench-$2.log
  cp /tmp/$2/results-gpt.md $OUT/results-$2.md 2>/dev/null; cp /tmp/$2/results-gpt.json $OUT/results-$2.json 2>/dev/null
}
for r in $(seq 1 ${ROUNDS:-1}); do run .before before-$r; run . after-$r; done
for f in $OUT/results-*.md; do echo "== $f"; grep -E "ours_|fsdp2_" $f | cut -d'|' -f2-5,8; done
