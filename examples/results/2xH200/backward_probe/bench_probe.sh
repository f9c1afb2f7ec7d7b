#!/bin/bash
# The backward probe's cost: per-layer graphs and segments before (.before: 7e43a97) and after (this tree), one session.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
S="fsdp2_eager ours_layer_graphs ours_segment_graphs"
run() {  # $1: tree, $2: name, $3: configs
  (cd $1 && PYTHONPATH=$PWD timeout ${T:-200} torchrun --standalone --nproc-per-node 2 examples/benchmark.py \
     --config $3 --systems $S --out /tmp/$2) > $OUT/bench-$2.log 2>&1
  echo "$2 rc=$?" >> $OUT/bench-$2.log
  cp /tmp/$2/results-gpt.md $OUT/results-$2.md 2>/dev/null; cp /tmp/$2/results-gpt.json $OUT/results-$2.json 2>/dev/null
}
run .before before "small medium"
run . after "small medium"
T=100 run .before before2 small
T=100 run . after2 small
grep -h "ours_\|fsdp2_eager" $OUT/results-*.md | cut -c1-110
