#!/bin/bash
# 2 GPUs: host timers before/after (ROUNDS rounds, CONFIGS) and the setter probe first, then GPU test files from QUEUE.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git log -1 --format='%H %s' > $OUT/info.txt 2>/dev/null; nvidia-smi -L >> $OUT/info.txt
printf "%s\n" $QUEUE > /tmp/queue
rm -rf .before/.probe; cp -r .probe .before/.probe
start=$(date +%s)
if [ -n "$CONFIGS" ]; then
  PYTHONPATH=$PWD timeout 60 torchrun --standalone --master-port 29612 --nproc-per-node 1 .probe/setter_probe.py > $OUT/setter_probe.txt 2>&1
  for round in $(seq 1 ${ROUNDS:-1}); do for tree in .before .; do
    name=$( [ $tree = . ] && echo after || echo before )-$round; mkdir -p /tmp/t-$name
    for cs in $CONFIGS; do
      (cd $tree && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD OUT=/tmp/t-$name timeout 120 torchrun --standalone --master-port 29611 --nproc-per-node 2 .probe/host_timers.py ${cs/:/ }) >> $OUT/timers-log.txt 2>&1
    done; done; done
  for d in /tmp/t-*; do n=$(basename $d); for f in $d/*.md; do [ -f "$f" ] && { echo "## $n $(basename $f)"; cat $f; echo; } >> $OUT/timers-all.md; done; done
  grep -h "plain" $OUT/timers-log.txt
fi
deadline=$((start + ${DEADLINE:-520}))
while f=$(head -1 /tmp/queue); [ -n "$f" ]; do
  sed -i 1d /tmp/queue
  left=$((deadline - $(date +%s))); [ $left -lt 20 ] && { echo "$f" | cat - /tmp/queue > /tmp/q2; mv /tmp/q2 /tmp/queue; break; }
  echo "=== $f" >> $OUT/worker-a.txt
  PYTHONPATH=$PWD timeout $left python3 -m pytest -v -p no:cacheprovider -m "not cpu_only" "$f" >> $OUT/worker-a.txt 2>&1
  echo "=== $f rc=$?" >> $OUT/worker-a.txt
done
cat $OUT/worker-*.txt | grep -E "^tests/.*::" | grep -oE " (PASSED|FAILED|ERROR|SKIPPED)" | sort | uniq -c
cat $OUT/worker-*.txt | grep -E "(FAILED|ERROR)" | head -20
grep -h "rc=" $OUT/worker-*.txt | grep -v "rc=0"; echo "left:"; cat /tmp/queue
