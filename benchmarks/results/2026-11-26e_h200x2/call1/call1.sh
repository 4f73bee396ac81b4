#!/usr/bin/env bash
# Call 1 (twenty-ninth session, 2x H200, main at c0df205; native code as e314df7):
# (1) build and issue 3's bench: BF16/FP8 x 24/16 SMs with the reference backend and the P2P ceiling in the same run;
# (2) the combine at 128 and 2048 tokens, 24 SMs, no baseline: default, EP_PLUGIN_COMBINE_SENDER=engine and
#     EP_PLUGIN_COMBINE_RELEASE_WAIT=start, alternating twice (the twenty-eighth session's sweep found 74.8 us at 128
#     tokens against 42.2 in the twenty-fifth session's).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/b BENCH_TIMEOUT=60 STAGES="build bench" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
VARIANTS="def_a||--sweep tokens=128,2048
eng_a|EP_PLUGIN_COMBINE_SENDER=engine|--sweep tokens=128,2048
rws_a|EP_PLUGIN_COMBINE_RELEASE_WAIT=start|--sweep tokens=128,2048
def_b||--sweep tokens=128,2048
eng_b|EP_PLUGIN_COMBINE_SENDER=engine|--sweep tokens=128,2048
rws_b|EP_PLUGIN_COMBINE_RELEASE_WAIT=start|--sweep tokens=128,2048" \
  OUT=$ALL/v BENCH_TIMEOUT=40 BUDGET_S=$((540 - SECONDS)) STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/stdout_v.txt 2>&1
echo "##### summary"; cat $ALL/b/summary.txt $ALL/v/summary.txt 2>/dev/null
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-170
grep -h "^=== bench\|^combine\|^dispatch" $ALL/v/bench.log | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//' | cut -c1-150
cd $ALL && tar -czf all.tgz b v *.txt 2>/dev/null; rm -rf b v stdout*.txt
