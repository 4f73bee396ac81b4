#!/usr/bin/env bash
# Call 3 (twenty-fourth session, 2 GPUs over NVLink), branch finish-fence: call 2's phase profile found the
# direct kernel's last block ending about 11 us after the blocks' rows were written, 5-7 us of it in each
# block's system-scope fence, and the start handshake at about 4 us on the rank that comes last. Two
# diagnostic switches: EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu (the blocks but the last fence at GPU scope; the last
# block's system fence is cumulative) and EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed (the peers' output offsets
# by relaxed loads after the acquire of their ready word).
# (1) the direct case sets with both switches on; (2) cached dispatch at 24 SMs, each switch alone and both.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=250 PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="multi_rank and direct_outputs" \
  EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/v BENCH_TIMEOUT=40 \
  VARIANTS=$'main_a||\nfence_a|EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu|\nloads_a|EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed|\nboth_a|EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed|\nmain_b||\nfence_b|EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu|\nboth_b|EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed|\nfp8_main||--dtype fp8\nfp8_both|EP_PLUGIN_DIRECT_BLOCK_FENCE=gpu EP_PLUGIN_DIRECT_EXCHANGE_LOADS=relaxed|--dtype fp8' \
  BUDGET_S=$((420 - SECONDS)) STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/stdout_v.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt; grep -v "^variant" $ALL/v/summary.txt
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log 2>/dev/null | cut -c1-300 | tail -10
grep -h "^=== bench\|^verified\|^dispatch" $ALL/v/bench.log | sed 's/.*results_dir.//; s/ --num-sms 24 --dtype bf16 --no-baseline --warmup 3 --iters 20//' | head -40
cd $ALL && tar -czf all.tgz c v stdout*.txt; rm -rf c v stdout*.txt
