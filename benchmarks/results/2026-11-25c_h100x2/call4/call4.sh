#!/usr/bin/env bash
# Call 4 (twenty-third session, 2 GPUs over NVLink): the low-latency dispatch's count words now carry a tag of
# the sender's layout (T_max, hidden, experts, FP8), checked by the receiver before it reads a message. (1) The
# low-latency file's cases (every dispatch announces its counts with the tag); (2) the device-error tests: ranks
# that disagree on topk_weights or the partials, and the new ones whose calls differ in T_max or use_fp8.
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ALL=$OUT
OUT=$ALL/c DEADLINE_S=250 PYTEST_ARGS="-q tests/test_native_low_latency.py" PYTEST_K="not missing_peer and not disagree" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
timeout -k 5 $((290 - SECONDS)) python3 -m pytest -q -rs -s tests/test_native_low_latency.py -k disagree > $ALL/c/disagree.log 2>&1
echo "disagree: rc=$?" >> $ALL/c/summary.txt
echo "##### summary"; cat $ALL/c/summary.txt
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | cut -c1-250 | tail -8
grep -h "passed\|failed\|FAILED\|laid out\|got a dispatch" $ALL/c/disagree.log | cut -c1-400 | tail -12
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
