#!/usr/bin/env bash
# Call 3 (twenty-first session, one H200). Call 1 again after the fix of the direct kernel's shared-memory
# alignment (call 2: 182 us against main's 117 at 1 rank, 16 blocks). The copy-engine dispatch rows
# (buffer.dispatch_copy_engine), new: (1) one rank, the plain direct kernel after its refactor, against
# last session's 118.1-118.6 us (16 blocks, 48 SMs); (2) two ranks sharing the GPU under MPS: the
# intranode tests of the direct paths, copy-engine rows included, then shared-GPU benches of the plain
# direct dispatch against copy-engine rows (not NVLink timings).
set -u
export MAX_JOBS=16
ALL=$OUT
printf 'buffer: {dispatch_copy_engine: true}\n' > /tmp/ce.yaml
OUT=$ALL/one BENCH_RANKS=1 BENCH_TIMEOUT=60 \
  VARIANTS=$'blocks16|EP_PLUGIN_DIRECT_MAX_BLOCKS=16|--num-sms 48\nblocks48|EP_PLUGIN_DIRECT_MAX_BLOCKS=48|--num-sms 48' \
  STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_one.txt 2>&1
OUT=$ALL/two DEADLINE_S=300 BENCH_RANKS=2 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="copy_engine or test_cases_multi_rank_direct_outputs" \
  VARIANTS=$'main||\ncopy_engine||--config /tmp/ce.yaml\nmain_fp8||--dtype fp8\ncopy_engine_fp8||--dtype fp8 --config /tmp/ce.yaml\ncopy_engine_48|EP_PLUGIN_STAGED_MAX_BLOCKS=48|--num-sms 48 --config /tmp/ce.yaml' \
  STAGES="share tests variants" bash benchmarks/gpu_session.sh > $ALL/stdout_two.txt 2>&1
for d in one two; do
  echo "##### $d: summary"; cat $ALL/$d/summary.txt
  [ -f $ALL/$d/tests.log ] && { echo "##### $d: tests"; grep -h "passed\|failed\|FAILED\|Error\|SKIPPED\|timeout" $ALL/$d/tests.log | tail -25; }
  echo "##### $d: variants"; grep -h "^=== bench\|^verified\|^dispatch\|^combine\|path" $ALL/$d/bench.log | sed 's/.*results_dir.//' | head -60
done
cd $ALL && tar -czf all.tgz one two stdout_one.txt stdout_two.txt && rm -rf one two stdout_one.txt stdout_two.txt
