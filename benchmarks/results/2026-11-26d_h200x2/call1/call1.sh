#!/usr/bin/env bash
# Call 1 (twenty-eighth session, 2x H200, main at e314df7): issue 3's whole test set on main's final build.
# (1) build; the layout, intranode and output-region files without their trapping tests; (2) the intranode
# file's timeout and disagreement tests (a missing peer in each path, out-of-range expert ids, disagreeing
# ranks); (3) the SM and token sweep plots with this build's combine (skipped if the budget is spent).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/t DEADLINE_S=400 PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py tests/test_output_region.py" \
  PYTEST_K="not missing_peer and not out_of_range and not disagree" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/o DEADLINE_S=$((SECONDS + 110)) TIMEOUTS_FILES="tests/test_native_intranode.py" TIMEOUTS_TEST_TIMEOUT=100 \
  STAGES="timeouts" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/s BENCH_TIMEOUT=70 BUDGET_S=$((545 - SECONDS)) STAGES="sweeps" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/t/summary.txt $ALL/o/summary.txt $ALL/s/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|timeout in\|Error" $ALL/t/tests.log $ALL/o/timeouts.log 2>/dev/null | cut -c1-300 | tail -12
grep -h "^=== bench\|^dispatch\|^combine" $ALL/s/bench.log 2>/dev/null | sed 's/.*results_dir.//' | cut -c1-160 | head -40
cd $ALL && tar -czf all.tgz t o s stdout.txt 2>/dev/null; cp s/results.tgz sweeps.tgz 2>/dev/null; rm -rf t o s stdout.txt
