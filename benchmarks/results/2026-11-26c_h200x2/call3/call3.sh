#!/usr/bin/env bash
# Call 3 (twenty-seventh session, 2x H200, branch combine-lean-start + L2 prefetches in the owner's reduction):
# (1) build; the intranode cases of every combine path, a copy-engine dispatch case, async, 1000 iterations,
#     the combine's missing-peer tests; (2) A/B variants alternating (BF16; 24 and 16 SMs): prefetch 0/1/2 and
#     the code before this session; (3) the bench (BF16/FP8 x 24/16 SMs, reference + P2P in the same run).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=250 HANG_RESERVE_S=0 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="(test_cases_multi_rank and not chunks and not copy_engine_dispatch and not register and not direct_outputs) or (copy_engine_dispatch and share_60) or 1000 or async or (missing_peer and combine)" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OLD="EP_PLUGIN_COMBINE_SENDER=engine EP_PLUGIN_COMBINE_JOIN_SIGNALS=1 EP_PLUGIN_COMBINE_PREFETCH=0"
VARIANTS="p1||
p0|EP_PLUGIN_COMBINE_PREFETCH=0|
p2|EP_PLUGIN_COMBINE_PREFETCH=2|
old|$OLD|
p1b||
p0b|EP_PLUGIN_COMBINE_PREFETCH=0|
p2b|EP_PLUGIN_COMBINE_PREFETCH=2|
p1_16||--num-sms 16
p0_16|EP_PLUGIN_COMBINE_PREFETCH=0|--num-sms 16
p2_16|EP_PLUGIN_COMBINE_PREFETCH=2|--num-sms 16
old_16|$OLD|--num-sms 16" OUT=$ALL/v BENCH_TIMEOUT=40 STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/stdout_v.txt 2>&1
OUT=$ALL/b BENCH_TIMEOUT=45 STAGES="bench" bash benchmarks/gpu_session.sh > $ALL/stdout_b.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/v/summary.txt $ALL/b/summary.txt 2>/dev/null | grep -v "^bench: rc=0"
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log 2>/dev/null | cut -c1-300 | tail -8
grep -h "^=== bench\|^combine" $ALL/v/bench.log | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//' | cut -c1-150
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
cd $ALL && tar -czf all.tgz c v b *.txt 2>/dev/null; rm -rf c v b stdout*.txt
