#!/usr/bin/env bash
# Call 4 (twenty-ninth session, 4x H200, main at 8fa669c, warm machine after call 3): the combine at 4 ranks.
# Bench variants, BF16, 24 SMs, no baseline: the SM combine with its ring sizes (combine.nvl_chunked_send_tokens /
# nvl_chunked_recv_tokens; default 6 / 128 at 3-8 ranks) and the copy-engine combine (combine_staging_tokens 4096)
# with the twenty-seventh session's switches (EP_PLUGIN_COMBINE_SENDER=engine, EP_PLUGIN_COMBINE_RELEASE_WAIT=start).
set -u
export MAX_JOBS=16 BENCH_RANKS=4
ALL=$OUT
OUT=$ALL/b STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
printf 'combine: {nvl_chunked_send_tokens: 4, nvl_chunked_recv_tokens: 128}\n' > /tmp/c4_128.yaml
printf 'combine: {nvl_chunked_send_tokens: 8, nvl_chunked_recv_tokens: 256}\n' > /tmp/c8_256.yaml
printf 'combine: {nvl_chunked_send_tokens: 16, nvl_chunked_recv_tokens: 512}\n' > /tmp/c16_512.yaml
printf 'buffer: {combine_staging_tokens: 4096}\n' > /tmp/ce.yaml
VARIANTS="def_a||
c4_128||--config /tmp/c4_128.yaml
c8_256||--config /tmp/c8_256.yaml
c16_512||--config /tmp/c16_512.yaml
ce||--config /tmp/ce.yaml
ce_engine|EP_PLUGIN_COMBINE_SENDER=engine|--config /tmp/ce.yaml
ce_start|EP_PLUGIN_COMBINE_RELEASE_WAIT=start|--config /tmp/ce.yaml
def_b||" OUT=$ALL/v BENCH_TIMEOUT=40 BUDGET_S=$((330 - SECONDS)) STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/b/summary.txt $ALL/v/summary.txt 2>/dev/null
grep -h "^=== bench\|^combine\|^dispatch_cached" $ALL/v/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//' | cut -c1-150
cd $ALL && tar -czf all.tgz b v stdout.txt 2>/dev/null; rm -rf b v stdout.txt
