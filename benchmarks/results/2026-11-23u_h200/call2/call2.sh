#!/usr/bin/env bash
# Call 2: A/B of the plain direct dispatch at 1 rank, main (0686d76, carried as old.tar) against the
# working tree, built and benched in turn on one machine (call 1 found 182 us at 16 blocks against last
# session's 118.6: code or machine?).
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ALL=$OUT
nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > $ALL/clocks_before.txt 2>&1
bench1() { EP_PLUGIN_DIRECT_MAX_BLOCKS=16 timeout 60 python3 -m ep_plugin bench --ranks 1 --num-sms 48 --dtype bf16 --no-baseline --warmup 3 --iters 20 2>&1 | grep -E "^dispatch|^combine"; }
mkdir -p /tmp/old && tar -xf .device/old.tar -C /tmp/old
( cd /tmp/old && python3 -m pip install --no-build-isolation --no-deps -e . > $ALL/build_old.log 2>&1 ) && echo "== old (0686d76)" && bench1 && bench1
python3 -m pip install --no-build-isolation --no-deps -e . > $ALL/build_new.log 2>&1 && echo "== new (working tree)" && bench1 && bench1
nvidia-smi -q -d CLOCK,PERFORMANCE > $ALL/clocks_after.txt 2>&1
grep -A4 "^    Clocks$\|Clocks Event Reasons" $ALL/clocks_before.txt | head -30
