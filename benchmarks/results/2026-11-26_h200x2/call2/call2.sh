#!/usr/bin/env bash
# Call 2 (twenty-fifth session, 2x H200 over NVLink, main at 013aa12):
# (1) build, the SM sweep (8..48) and the token sweep (128..16384) with plots;
# (2) the rest of the intranode file with the layout and output-region files;
# (3) the timeout and disagreement tests (intranode, internode), each file alone.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c BENCH_TIMEOUT=120 STAGES="build sweeps" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/rest DEADLINE_S=$((560 - SECONDS)) HANG_RESERVE_S=150 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_layout.py tests/test_output_region.py" \
  PYTEST_K="not multi_rank and not fall_back and not row_layout and not missing_peer and not out_of_range and not disagree" \
  TIMEOUTS_FILES="tests/test_native_intranode.py tests/test_native_internode.py" TIMEOUTS_TEST_TIMEOUT=90 \
  STAGES="tests timeouts" bash benchmarks/gpu_session.sh > $ALL/stdout_rest.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/rest/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/rest/tests.log $ALL/rest/timeouts.log 2>/dev/null | cut -c1-300 | tail -14
grep -h "^=== bench\|^num_sms\|^tokens\|^dispatch\|^combine\|^ *[0-9]" $ALL/c/bench.log | cut -c1-160 | head -60
cd $ALL && tar -xzf c/results.tgz 2>/dev/null; ls
tar -czf all.tgz c rest stdout*.txt 2>/dev/null; rm -rf c rest stdout*.txt
