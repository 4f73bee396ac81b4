#!/usr/bin/env bash
# Call 3 (eighteenth session): claimed chunks (default 1 token) and the ring kernel launched as a
# programmatic dependent of the direct kernel. Normal build: the direct, chunk, auto-region, fallback
# and ring case tests, the output-region tests, the timeout tests, the bench with the reference, then
# variants (fixed shares, chunks of 2).
set -u
export MAX_JOBS=16
ALL=$OUT
VARIANTS="chunk1_bf16||
chunk0_bf16|EP_PLUGIN_DIRECT_CHUNK=0|
chunk2_bf16|EP_PLUGIN_DIRECT_CHUNK=2|
chunk1_fp8||--dtype fp8
chunk0_fp8|EP_PLUGIN_DIRECT_CHUNK=0|--dtype fp8
chunk1_blocks24_fp8|EP_PLUGIN_DIRECT_MAX_BLOCKS=24|--dtype fp8" \
OUT=$ALL/c DEADLINE_S=540 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_output_region.py" \
  PYTEST_K="direct_outputs or auto_output_region or fall_back or test_cases_multi_rank or test_output_region" \
  STAGES="build tests timeouts bench variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -12
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -90
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
