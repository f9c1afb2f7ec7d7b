#!/bin/bash
# GPU tests of the changed paths on GPUs 0,1 (queue) while GPUs 2,3 time the host path before/after, then help.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
git log -1 --format='%H %s' > $OUT/info.txt 2>/dev/null; nvidia-smi -L >> $OUT/info.txt
printf "%s\n" $QUEUE > /tmp/queue
rm -rf .before/.probe; cp -r .probe .before/.probe
worker() {  # $1: id, $2: GPUs
  while [ ! -f /tmp/stop ]; do
    f=$(flock /tmp/queue.lock sh -c 'head -1 /tmp/queue; sed -i 1d /tmp/queue')
    [ -z "$f" ] && break
    echo "=== $f" >> $OUT/worker-$1.txt
    CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=$PWD timeout 300 python3 -m pytest -v -p no:cacheprovider -m "not cpu_only" "$f" >> $OUT/worker-$1.txt 2>&1
    echo "=== $f rc=$?" >> $OUT/worker-$1.txt
  done
}
timers() {  # GPUs 2,3: before/after, alternating, deterministic host timers
  for round in 1 2; do for tree in .before .; do for cs in "small ours_layer_graphs" "small ours_segment_graphs" "medium ours_layer_graphs" "medium ours_segment_graphs"; do
    name=$( [ $tree = . ] && echo after || echo before )-$round
    (cd $tree && CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=$PWD OUT=/tmp/t-$name timeout 120 torchrun --standalone --master-port 29611 --nproc-per-node 2 .probe/host_timers.py $cs) >> $OUT/timers-log.txt 2>&1
  done; mkdir -p /tmp/t-$name; done; done
}
mkdir -p /tmp/t-before-1 /tmp/t-after-1 /tmp/t-before-2 /tmp/t-after-2
rm -f /tmp/stop
worker a 0,1 & pa=$!
( timers; worker b 2,3 ) & pb=$!
( sleep ${DEADLINE:-500}; touch /tmp/stop; pkill -f "pytest -v -p no:cacheprovider"; pkill -f host_timers ) & killer=$!
wait $pa $pb; kill $killer 2>/dev/null
for d in /tmp/t-*; do n=$(basename $d); for f in $d/*.md; do [ -f "$f" ] && { echo "## $n $(basename $f)"; cat $f; echo; } >> $OUT/timers-all.md; done; done
grep -h "plain" $OUT/timers-log.txt
cat $OUT/worker-*.txt | grep -E "^tests/.*::" | grep -oE " (PASSED|FAILED|ERROR|SKIPPED)" | sort | uniq -c
cat $OUT/worker-*.txt | grep -E "(FAILED|ERROR)" | head -20
grep -h "rc=" $OUT/worker-*.txt; echo "left:"; cat /tmp/queue
