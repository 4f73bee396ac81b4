#!/usr/bin/env bash
# Call 4 (eighteenth session): how many chunks a direct-dispatch warp claims ahead
# (EP_PLUGIN_DIRECT_CLAIM_AHEAD 0 / 1 / 2; call 3 ran 2); the next row's positions now load after
# the row copy. Tests: the direct cases and the chunk / claim-ahead cases.
set -u
export MAX_JOBS=16
ALL=$OUT
VARIANTS="ahead1_bf16||
ahead0_bf16|EP_PLUGIN_DIRECT_CLAIM_AHEAD=0|
ahead2_bf16|EP_PLUGIN_DIRECT_CLAIM_AHEAD=2|
ahead1_fp8||--dtype fp8
ahead0_fp8|EP_PLUGIN_DIRECT_CLAIM_AHEAD=0|--dtype fp8
ahead2_fp8|EP_PLUGIN_DIRECT_CLAIM_AHEAD=2|--dtype fp8
ahead1_bf16_again||
ahead0_bf16_again|EP_PLUGIN_DIRECT_CLAIM_AHEAD=0|
ahead1_blocks24_bf16|EP_PLUGIN_DIRECT_MAX_BLOCKS=24|
ahead0_blocks24_bf16|EP_PLUGIN_DIRECT_CLAIM_AHEAD=0 EP_PLUGIN_DIRECT_MAX_BLOCKS=24|" \
OUT=$ALL/c DEADLINE_S=420 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="direct_outputs" \
  STAGES="build tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | tail -12
echo "##### bench"; grep -h "^=== bench\|^verified\|^dispatch\|^combine" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -90
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
