#!/usr/bin/env bash
# Call 6 (twenty-first session, one H200): after the review (finish_direct waits through wait_for_word;
# one staged_x_offset for host and device), 2 ranks under MPS: the direct and copy-engine dispatch tests.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=170 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="copy_engine or test_cases_multi_rank_direct_outputs" \
  STAGES="build share tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | tail -10
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
