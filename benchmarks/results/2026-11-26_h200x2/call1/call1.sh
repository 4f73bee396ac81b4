#!/usr/bin/env bash
# Call 1 (twenty-fifth session, 2x H200 over NVLink, main at 013aa12):
# (1) build, then the bench: BF16/FP8 x 24/16 SMs with the reference and the P2P ceiling in the same run, and the
#     combine on the SMs alone;
# (2) every multi-rank case set of the intranode file, the fallbacks, the row-layout and out-of-range tests
#     (intranode and internode, in their refactored form).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c BENCH_TIMEOUT=45 STAGES="build bench" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/t DEADLINE_S=$((575 - SECONDS)) \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_internode.py" \
  PYTEST_K="multi_rank or fall_back or row_layout or out_of_range" \
  STAGES="tests" bash benchmarks/gpu_session.sh > $ALL/stdout_t.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt 2>/dev/null
head -3 $ALL/c/build.log
grep -h "passed\|failed\|FAILED\|Error" $ALL/t/tests.log 2>/dev/null | cut -c1-300 | tail -12
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -60
cd $ALL && cp c/results_dir/*.json . 2>/dev/null; cp c/bench.log t/tests.log . 2>/dev/null
tar -czf all.tgz c t stdout*.txt 2>/dev/null; rm -rf c t stdout*.txt
