#!/usr/bin/env bash
# Call 3 (twenty-eighth session, 4x H200, main at e314df7): the 8-GPU issue's EP4 runs, part 2.
# (1) build; (2) the low-latency file at 4 ranks without its trapping tests; (3) the timeout and disagreement
# tests of the intranode and low-latency files at 4 ranks (each rank on its own GPU); (4) the internode
# file's 4-GPU tests (2 emulated nodes x 2 GPUs and 4 x 1, with NVLink forwarding; CUDA graph of 2 x 2);
# (5) the reference backend's tests at 4 ranks. Each later step is skipped once its time is spent.
set -u
export MAX_JOBS=16 EP_TEST_RANKS=4
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
step() {  # step NAME LIMIT_S ARGS...: pytest ARGS with at most LIMIT_S seconds, skipped past 560 s
  local name=$1 limit=$2; shift 2
  local left=$((560 - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 30 ] && { echo "$name: skipped (time)" >> $ALL/summary.txt; return; }
  local start=$SECONDS
  timeout -k 5 "$limit" python3 -m pytest -q -rs --durations=8 "$@" > $ALL/$name.log 2>&1
  echo "$name: rc=$?, $((SECONDS - start)) s; $(grep -h 'passed\|failed' $ALL/$name.log | tail -1)" >> $ALL/summary.txt
}
step ll 150 tests/test_native_low_latency.py -k "not missing_peer and not disagree"
step timeouts_intranode 110 -s -o faulthandler_timeout=100 tests/test_native_intranode.py -k "missing_peer or out_of_range or disagree"
step timeouts_ll 90 -s -o faulthandler_timeout=80 tests/test_native_low_latency.py -k "missing_peer or disagree"
step internode4 120 tests/test_native_internode.py -k "four_ranks or two_nodes_of_two"
step reference4 90 tests/test_reference_normal.py tests/test_reference_low_latency.py -k "4ranks"
echo "##### summary"; cat $ALL/c/summary.txt $ALL/summary.txt
for f in ll timeouts_intranode timeouts_ll internode4 reference4; do grep -h "FAILED\|timeout in\|SKIPPED\|Error" $ALL/$f.log 2>/dev/null | cut -c1-250 | head -6; done
cd $ALL && tar -czf all.tgz c *.log summary.txt stdout.txt 2>/dev/null; rm -rf c stdout.txt
