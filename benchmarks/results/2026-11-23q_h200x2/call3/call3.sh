#!/usr/bin/env bash
# Call 3 (seventeenth session): branch direct-region-fallback with `buffer.dispatch_output_bytes: auto` (the
# direct dispatch by default at 1-2 ranks, the allocator in the extension, the fallback to the rings when a
# region is full): the layout, intranode and output-region test files, the timeout tests, the bench with
# the reference (the default path: direct), then the ring path (dispatch_output_bytes 0) on the same machine.
set -u
export MAX_JOBS=16
ALL=$OUT
R=.device/rings.yaml
VARIANTS="rings_bf16_24||--config $R
rings_fp8_24||--dtype fp8 --config $R
rings_bf16_16||--num-sms 16 --config $R
rings_fp8_16||--dtype fp8 --num-sms 16 --config $R" \
OUT=$ALL/c DEADLINE_S=560 HANG_RESERVE_S=80 BENCH_TIMEOUT=60 TIMEOUTS_FILES=tests/test_native_intranode.py \
  PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py tests/test_output_region.py" \
  STAGES="build tests timeouts bench variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -12
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -120
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
