#!/usr/bin/env bash
# Call 5 (twenty-ninth session, 4x H200, main at 8fa669c, warm machine after call 4): the SM combine's ring sizes at
# 4 ranks, below call 4's best (4 / 128: 924.5 us against the default 6 / 128's 965.5 / 960.9). Bench variants, BF16,
# no baseline, 24 SMs unless said: combine.nvl_chunked_send_tokens / nvl_chunked_recv_tokens.
set -u
export MAX_JOBS=16 BENCH_RANKS=4
ALL=$OUT
OUT=$ALL/b STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
for r in 2_128 4_128 2_64 4_64 3_96 2_32; do
  printf 'combine: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\n' ${r%_*} ${r#*_} > /tmp/c$r.yaml
done
VARIANTS="c2_128||--config /tmp/c2_128.yaml
c4_128||--config /tmp/c4_128.yaml
c2_64||--config /tmp/c2_64.yaml
c4_64||--config /tmp/c4_64.yaml
c3_96||--config /tmp/c3_96.yaml
c2_32||--config /tmp/c2_32.yaml
def||
c4_128_16||--config /tmp/c4_128.yaml --num-sms 16
c2_64_16||--config /tmp/c2_64.yaml --num-sms 16" OUT=$ALL/v BENCH_TIMEOUT=40 BUDGET_S=$((300 - SECONDS)) \
  STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/b/summary.txt $ALL/v/summary.txt 2>/dev/null
grep -h "^=== bench\|^combine" $ALL/v/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//' | cut -c1-150
cd $ALL && tar -czf all.tgz b v stdout.txt 2>/dev/null; rm -rf b v stdout.txt
