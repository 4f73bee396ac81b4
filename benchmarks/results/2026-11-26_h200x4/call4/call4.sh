#!/usr/bin/env bash
# Call 4 (twenty-eighth session, 4x H200, main at fc209bd): what call 3 left. (1) build; (2) the low-latency file's fp32-partials
# cases at 4 ranks (call 3's 150 s limit ended while they ran; its other 61 cases passed); (3) the reference
# backend's tests at 4 ranks again, with the test fix (compare on the CPU, either side a GPU tensor).
set -u
export MAX_JOBS=16 EP_TEST_RANKS=4
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
step() {  # step NAME LIMIT_S ARGS...: pytest ARGS with at most LIMIT_S seconds, skipped past 250 s
  local name=$1 limit=$2; shift 2
  local left=$((250 - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 20 ] && { echo "$name: skipped (time)" >> $ALL/summary.txt; return; }
  local start=$SECONDS
  timeout -k 5 "$limit" python3 -m pytest -q -rs --durations=8 "$@" > $ALL/$name.log 2>&1
  echo "$name: rc=$?, $((SECONDS - start)) s; $(grep -h 'passed\|failed' $ALL/$name.log | tail -1)" >> $ALL/summary.txt
}
step ll_fp32 165 tests/test_native_low_latency.py -k "fp32_partials and not missing_peer and not disagree"
step reference4 60 tests/test_reference_normal.py tests/test_reference_low_latency.py -k "4ranks"
echo "##### summary"; cat $ALL/c/summary.txt $ALL/summary.txt
for f in ll_fp32 reference4; do grep -h "FAILED\|timeout in\|SKIPPED\|Error" $ALL/$f.log 2>/dev/null | cut -c1-250 | head -6; done
cd $ALL && tar -czf all.tgz c *.log summary.txt stdout.txt 2>/dev/null; rm -rf c stdout.txt
