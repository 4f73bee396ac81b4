#!/usr/bin/env bash
# Call 2 (seventeenth session): the output region's allocator in the extension (DLPack tensors) and the
# fallback to the rings when a rank's region is full: direct and ring case tests, the fallback tests,
# the timeout tests, the host time of the allocation, one bench run of each path.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="direct_bf16_24||--config $D
direct_fp8_24||--dtype fp8 --config $D
rings_bf16_24||
direct_bf16_16||--num-sms 16 --config $D" \
OUT=$ALL/c DEADLINE_S=520 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_output_region.py" \
  PYTEST_K="direct_outputs or fall_back or test_cases_multi_rank or output_region or group or block or region or byte_shape" \
  STAGES="build tests timeouts variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
python3 .device/host_alloc.py > $ALL/c/host_alloc.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -12
echo "##### host alloc"; cat $ALL/c/host_alloc.txt
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
