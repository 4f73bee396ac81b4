#!/usr/bin/env bash
# Call 1 (seventeenth session): how far the bulk copies' loads run ahead of their stores
# (EP_PLUGIN_BULK_LOADS_AHEAD; stores whose reads of shared memory may be pending: 7 - that).
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="direct_bf16_a6||--config $D
direct_bf16_a4|EP_PLUGIN_BULK_LOADS_AHEAD=4|--config $D
direct_bf16_a3|EP_PLUGIN_BULK_LOADS_AHEAD=3|--config $D
direct_bf16_a2|EP_PLUGIN_BULK_LOADS_AHEAD=2|--config $D
direct_fp8_a6||--dtype fp8 --config $D
direct_fp8_a4|EP_PLUGIN_BULK_LOADS_AHEAD=4|--dtype fp8 --config $D
direct_fp8_a3|EP_PLUGIN_BULK_LOADS_AHEAD=3|--dtype fp8 --config $D
direct_fp8_a2|EP_PLUGIN_BULK_LOADS_AHEAD=2|--dtype fp8 --config $D
rings_bf16_a6||
rings_bf16_a3|EP_PLUGIN_BULK_LOADS_AHEAD=3|
rings_fp8_a3|EP_PLUGIN_BULK_LOADS_AHEAD=3|--dtype fp8
direct_bf16_a1|EP_PLUGIN_BULK_LOADS_AHEAD=1|--config $D" \
OUT=$ALL/c DEADLINE_S=420 BENCH_TIMEOUT=60 STAGES="build variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### bench"; grep -h "^=== bench\|^dispatch\|^combine" $ALL/stdout.txt | sed 's/.*variant_//;s/.json.*//' | head -60
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
