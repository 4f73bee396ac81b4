#!/usr/bin/env bash
# Call 4 (sixteenth session): branch dispatch-direct-outputs with the direct dispatch on 16 blocks by default:
# the layout and intranode files (direct cases included), the timeout tests (a missing peer in a direct
# cached dispatch included), the bench with the reference (ring dispatch, the default), then the direct
# dispatch at 24 and 16 SMs, BF16 and FP8.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="direct_bf16_24||--config $D
direct_fp8_24||--dtype fp8 --config $D
direct_bf16_16||--num-sms 16 --config $D
direct_fp8_16||--dtype fp8 --num-sms 16 --config $D" \
OUT=$ALL/c DEADLINE_S=560 HANG_RESERVE_S=80 BENCH_TIMEOUT=60 TIMEOUTS_FILES=tests/test_native_intranode.py \
  PYTEST_ARGS="tests/test_native_layout.py tests/test_native_intranode.py" STAGES="build tests timeouts bench variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -12
echo "##### bench"; grep -h "^ep_plugin bench\|^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference\|variant" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -110
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
