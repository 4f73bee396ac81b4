#!/usr/bin/env bash
# Call 8 (twenty-second session): `status` listed nvidia-h100-x2 at the end of the session, with ~340 s of device
# time left. Over NVLink (2x H100), the copy-engine dispatch rows against the SM rows, and the new split of x
# (EP_PLUGIN_DISPATCH_CE_SHARE): BF16/FP8, 24 SMs, cached dispatch, each run verified against the reference.
set -u
export MAX_JOBS=16
printf 'buffer: {dispatch_copy_engine: true}\n' > /tmp/ce.yaml
BUDGET_S=200 BENCH_TIMEOUT=40 \
  VARIANTS=$'main||\nce100||--config /tmp/ce.yaml\nce80|EP_PLUGIN_DISPATCH_CE_SHARE=80|--config /tmp/ce.yaml\nce50|EP_PLUGIN_DISPATCH_CE_SHARE=50|--config /tmp/ce.yaml\nmain_fp8||--dtype fp8\nce100_fp8||--dtype fp8 --config /tmp/ce.yaml\nce65|EP_PLUGIN_DISPATCH_CE_SHARE=65|--config /tmp/ce.yaml\nce90|EP_PLUGIN_DISPATCH_CE_SHARE=90|--config /tmp/ce.yaml' \
  STAGES="build variants" bash benchmarks/gpu_session.sh > $OUT/stdout.txt 2>&1
head -3 $OUT/build.log
cat $OUT/summary.txt
grep -h "^=== bench\|^verified\|^dispatch\|^cached\|^combine\|path" $OUT/bench.log | sed 's/.*results_dir.//' | head -60
