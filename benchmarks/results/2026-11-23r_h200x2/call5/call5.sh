#!/usr/bin/env bash
# Call 5 (eighteenth session): main candidate (claims of 1 token when needed, dependent launch of the
# ring kernel, diagnostics removed). Normal build: the direct, chunk, auto-region, fallback and ring case
# tests, the output-region tests, the timeout tests, and the bench with the reference.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=450 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_output_region.py" \
  PYTEST_K="direct_outputs or auto_output_region or fall_back or test_cases_multi_rank or test_output_region" \
  STAGES="build tests timeouts bench" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -12
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
