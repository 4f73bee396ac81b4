#!/usr/bin/env bash
# Call 3 (twenty-fifth session, 2x H200 over NVLink, main at 013aa12):
# (1) build, the bench once more (BF16/FP8 x 24/16 SMs, reference and P2P ceiling in the same run);
# (2) variants, BF16 cached dispatch at 24 SMs: the SM rows (main) against the copy-engine rows (ce, and ce90 with
#     the SMs storing the first 10% of the tokens), main again;
# (3) the low-latency tests and benchmark (128 tokens and the token sweep), fp32 partials beside.
set -u
export MAX_JOBS=16
ALL=$OUT
printf 'buffer: {dispatch_copy_engine: true}\n' > /tmp/ce.yaml
OUT=$ALL/c BENCH_TIMEOUT=60 \
  VARIANTS=$'main_a||\nce||--config /tmp/ce.yaml\nce90|EP_PLUGIN_DISPATCH_CE_SHARE=90|--config /tmp/ce.yaml\nmain_b||' \
  STAGES="build bench variants" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/ll BENCH_TIMEOUT=$((560 - SECONDS > 100 ? 100 : 560 - SECONDS)) LL_TEST_TIMEOUT=$((450 - SECONDS)) \
  BUDGET_S=$((540 - SECONDS)) STAGES="ll" bash benchmarks/gpu_session.sh > $ALL/stdout_ll.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/ll/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/ll/tests.log 2>/dev/null | cut -c1-300 | tail -6
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150 | head -70
tail -30 $ALL/ll/bench.log 2>/dev/null | cut -c1-160
cd $ALL && tar -xzf c/results.tgz 2>/dev/null; tar -xzf ll/results.tgz 2>/dev/null
tar -czf all.tgz c ll stdout*.txt 2>/dev/null; rm -rf c ll stdout*.txt
