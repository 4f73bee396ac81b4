#!/usr/bin/env bash
# Call 3 (twenty-ninth session, 4x H200): `buffer.dispatch_output_bytes: auto` now gives the direct dispatch a
# region at 1 to 4 ranks (room for two dispatches of 4096 tokens per rank from every rank: 32768 rows at 4).
# (1) build; the layout, intranode and output-region files at 4 ranks without their trapping tests (the default
#     path at 4 ranks is now the direct dispatch: test_cases_multi_rank_auto_output_region checks it);
# (2) `ep-plugin bench` at 4 ranks with the new default: BF16/FP8 x 24/16 SMs, the reference and the P2P ceiling
#     in the same run; (3) if time is left, the copy-engine combine's timeline at 4 ranks on 48 SMs (is its
#     reduction short of SMs?).
set -u
export MAX_JOBS=16 EP_TEST_RANKS=4 BENCH_RANKS=4
ALL=$OUT
OUT=$ALL/t DEADLINE_S=400 PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py tests/test_output_region.py" \
  PYTEST_K="not missing_peer and not out_of_range and not disagree" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/b BENCH_TIMEOUT=45 BUDGET_S=$((500 - SECONDS)) STAGES="bench" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/c CTL_STAGING=4096 CTL_SMS=48 BUDGET_S=$((550 - SECONDS)) STAGES="ctimeline" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/t/summary.txt $ALL/b/summary.txt $ALL/c/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|timeout in\|Error" $ALL/t/tests.log 2>/dev/null | cut -c1-300 | tail -10
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
grep -A9 "^rank" $ALL/c/ctimeline.log 2>/dev/null | cut -c1-120
cd $ALL && tar -czf all.tgz t b c stdout.txt 2>/dev/null; rm -rf t b c stdout.txt
