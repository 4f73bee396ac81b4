#!/usr/bin/env bash
# Call 2 (twenty-ninth session, 4x H200, main at c0df205; native code as e314df7): EP4 speed.
# (1) build; (2) bench variants at 4 ranks, BF16, no baseline: the ring dispatch (the 4-rank default) against the
#     direct dispatch (buffer.dispatch_output_bytes: 600000000, room for two dispatches' outputs), alternating at
#     24 SMs, then both at 16 and 48 SMs (does the SM combine scale with SMs?); (3) the copy-engine combine's
#     timeline at 4 ranks (combine_timeline.py --staging-tokens 4096).
set -u
export MAX_JOBS=16 BENCH_RANKS=4
ALL=$OUT
OUT=$ALL/b STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
printf 'buffer: {dispatch_output_bytes: 600000000}\n' > /tmp/direct.yaml
VARIANTS="ring24a||
dir24a||--config /tmp/direct.yaml
ring24b||
dir24b||--config /tmp/direct.yaml
ring16||--num-sms 16
dir16||--config /tmp/direct.yaml --num-sms 16
ring48||--num-sms 48
dir48||--config /tmp/direct.yaml --num-sms 48" OUT=$ALL/v BENCH_TIMEOUT=40 BUDGET_S=$((400 - SECONDS)) \
  STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/c CTL_STAGING=4096 BUDGET_S=$((450 - SECONDS)) STAGES="ctimeline" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/b/summary.txt $ALL/v/summary.txt $ALL/c/summary.txt 2>/dev/null
grep -h "^=== bench\|^dispatch\|^combine\|^P2P" $ALL/v/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
tail -45 $ALL/c/ctimeline.log 2>/dev/null | cut -c1-200
cd $ALL && tar -czf all.tgz b v c stdout.txt 2>/dev/null; rm -rf b v c stdout.txt
