#!/bin/bash
# The whole GPU suite on 4 GPUs: two workers (GPUs 0,1 and 2,3) take test files from one queue.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $OUT/gpus.txt; git log -1 --format='%H %s' >> $OUT/gpus.txt 2>/dev/null
if [ -n "$QUEUE" ]; then printf "%s\n" $QUEUE > /tmp/queue; else python3 -m pytest --collect-only -q -m "not cpu_only" tests 2>/dev/null | grep "::" | cut -d: -f1 | uniq -c | sort -rn | awk '{print $2}' > /tmp/queue; fi
wc -l /tmp/queue >> $OUT/gpus.txt
worker() {  # $1: worker id, $2: CUDA_VISIBLE_DEVICES
  while [ ! -f /tmp/stop ]; do
    f=$(flock /tmp/queue.lock sh -c 'head -1 /tmp/queue; sed -i 1d /tmp/queue')
    [ -z "$f" ] && break
    echo "=== $f" >> $OUT/worker-$1.txt
    CUDA_VISIBLE_DEVICES=$2 timeout 400 python3 -m pytest -v -p no:cacheprovider -m "not cpu_only" "$f" >> $OUT/worker-$1.txt 2>&1
    echo "=== $f rc=$?" >> $OUT/worker-$1.txt
  done
}
deadline=${1:-560}
rm -f /tmp/stop
worker a 0,1 & pa=$!
worker b 2,3 & pb=$!
( sleep $deadline; touch /tmp/stop; pkill -f "pytest -v -p no:cacheprovider" ) & killer=$!
wait $pa $pb; kill $killer 2>/dev/null
echo "left in queue:" >> $OUT/gpus.txt; cat /tmp/queue >> $OUT/gpus.txt
cat $OUT/worker-*.txt | grep -E "^tests/.*(PASSED|FAILED|ERROR|SKIPPED)" | awk '{print $2}' | sort | uniq -c
cat $OUT/worker-*.txt | grep -E "(FAILED|ERROR)" | head -20
grep -h "rc=" $OUT/worker-*.txt | grep -v "rc=0" ; cat /tmp/queue
