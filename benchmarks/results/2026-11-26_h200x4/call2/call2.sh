#!/usr/bin/env bash
# Call 2 (twenty-eighth session, 4x H200, main at e314df7): the 8-GPU issue's EP4 runs, part 1.
# (1) build; the layout and intranode files at 4 ranks without their trapping tests (the copy-engine combine's
# cases, the direct dispatch's cases and every other path at 4 ranks on their own GPUs); (2) `ep-plugin bench`
# at 4 ranks (BF16/FP8 x 24/16 SMs, the reference and the P2P ceiling in the same run; the SM combine);
# (3) the copy-engine combine at 4 ranks (combine_staging_tokens: 4096), 24 and 16 SMs; (4) the low-latency
# bench at 4 ranks (its tests run in call 2).
set -u
export MAX_JOBS=16 EP_TEST_RANKS=4 BENCH_RANKS=4
ALL=$OUT
nvidia-smi topo -m > $ALL/topo.txt 2>&1
OUT=$ALL/t DEADLINE_S=390 PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py" \
  PYTEST_K="not missing_peer and not out_of_range and not disagree" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/b BENCH_TIMEOUT=45 BUDGET_S=$((470 - SECONDS)) STAGES="bench" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
printf 'buffer: {combine_staging_tokens: 4096}\n' > /tmp/ce_combine.yaml
VARIANTS="ce24||--config /tmp/ce_combine.yaml
ce16||--config /tmp/ce_combine.yaml --num-sms 16" OUT=$ALL/v BENCH_TIMEOUT=30 BUDGET_S=$((510 - SECONDS)) \
  STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/l LL_TESTS=0 LL_FP32_PARTIALS=0 BENCH_TIMEOUT=$((570 - SECONDS)) BUDGET_S=$((540 - SECONDS)) \
  STAGES="ll" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; head -3 $ALL/topo.txt | cut -c1-120; cat $ALL/t/summary.txt $ALL/b/summary.txt $ALL/v/summary.txt $ALL/l/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|timeout in\|Error" $ALL/t/tests.log 2>/dev/null | cut -c1-300 | tail -10
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log $ALL/v/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
tail -30 $ALL/l/bench.log 2>/dev/null | cut -c1-160
cd $ALL && tar -czf all.tgz t b v l stdout.txt topo.txt 2>/dev/null; rm -rf t b v l stdout.txt
