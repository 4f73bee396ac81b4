#!/usr/bin/env bash
# Call 4 (twenty-fourth session, 2 GPUs over NVLink), branch finish-fence with its new defaults (the direct
# kernel's blocks fence at GPU scope before their count, the peers' output offsets by relaxed loads):
# (1) build, every multi-rank case set of the intranode file with the fallbacks and the row-layout test, then
#     the bench with the reference and the P2P ceiling in the same run;
# (2) if time is left: the rest of the intranode file with the layout and output-region files.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=270 BENCH_TIMEOUT=40 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="multi_rank or fall_back or row_layout" \
  STAGES="build tests bench" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
if [ $SECONDS -lt 350 ]; then
  OUT=$ALL/rest DEADLINE_S=$((485 - SECONDS)) \
    PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_layout.py tests/test_output_region.py" \
    PYTEST_K="not multi_rank and not fall_back and not row_layout and not missing_peer and not out_of_range and not disagree" \
    STAGES="tests" bash benchmarks/gpu_session.sh > $ALL/stdout_rest.txt 2>&1
fi
echo "##### summary"; cat $ALL/c/summary.txt; cat $ALL/rest/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/rest/tests.log 2>/dev/null | cut -c1-300 | tail -12
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -60
cd $ALL && tar -czf all.tgz c rest stdout*.txt 2>/dev/null; rm -rf c rest stdout*.txt
