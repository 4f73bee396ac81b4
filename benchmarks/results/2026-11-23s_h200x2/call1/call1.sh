#!/usr/bin/env bash
# Call 1 (nineteenth session): branch combine-early-rows (the copy-engine combine's owner sums rows as
# they land; the first round of pieces goes out as one copy). Tests of the combine paths, the CUDA
# graph, async, 1000-iteration and timeout tests, the bench with the reference, and variants:
# early rows off (the old path), and early rows with copies of 1 / 2 / 4 pieces.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=330 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank or back_to_back or graph or async_events" \
  STAGES="build tests timeouts bench variants" \
  VARIANTS="early0|EP_PLUGIN_COMBINE_EARLY_ROWS=0|
pieces1|EP_PLUGIN_COMBINE_COPY_PIECES=1|
pieces2|EP_PLUGIN_COMBINE_COPY_PIECES=2|
pieces4|EP_PLUGIN_COMBINE_COPY_PIECES=4|
whole|EP_PLUGIN_COMBINE_COPY_PIECES=0|" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -16
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -80
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
