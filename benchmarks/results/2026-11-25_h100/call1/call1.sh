#!/usr/bin/env bash
# Call 1 (twenty-second session, one H200: no 2-GPU kind was lent). (1) Two ranks sharing the GPU under
# CUDA MPS: the copy-engine dispatch tests with the new split of x (EP_PLUGIN_DISPATCH_CE_SHARE 60 and 1,
# and an x larger than the staging area staged in part), the direct dispatch's cases and the region-full
# fallback; then shared-GPU benches of the split (not NVLink timings). (2) Eight ranks sharing the GPU:
# the low-latency test file, never run at 8 ranks (issue 8; correctness only).
set -u
export MAX_JOBS=16
ALL=$OUT
printf 'buffer: {dispatch_copy_engine: true}\n' > /tmp/ce.yaml
OUT=$ALL/two DEADLINE_S=250 BENCH_RANKS=2 BENCH_TIMEOUT=60 PYTEST_ARGS="-v tests/test_native_intranode.py" \
  PYTEST_K="copy_engine or test_cases_multi_rank_direct_outputs" \
  VARIANTS=$'main||\nce100||--config /tmp/ce.yaml\nce80|EP_PLUGIN_DISPATCH_CE_SHARE=80|--config /tmp/ce.yaml\nce50|EP_PLUGIN_DISPATCH_CE_SHARE=50|--config /tmp/ce.yaml' \
  STAGES="build share tests variants" bash benchmarks/gpu_session.sh > $ALL/stdout_two.txt 2>&1
echo quit | nvidia-cuda-mps-control; sleep 3
OUT=$ALL/eight RANKS_PER_GPU=8 EP_TEST_RANKS=8 EP_TEST_MAX_SMS=12 DEADLINE_S=$((560 - SECONDS)) \
  PYTEST_ARGS="-v tests/test_native_low_latency.py" PYTEST_K="not missing_peer and not disagree" \
  STAGES="share tests" bash benchmarks/gpu_session.sh > $ALL/stdout_eight.txt 2>&1
for d in two eight; do
  echo "##### $d: summary"; cat $ALL/$d/summary.txt
  echo "##### $d: tests"; grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|timeout\|Timeout" $ALL/$d/tests.log | cut -c1-300 | tail -40
done
echo "##### variants"; grep -h "^=== bench\|^verified\|^dispatch\|^cached\|^combine\|path" $ALL/two/bench.log | sed 's/.*results_dir.//' | head -60
cd $ALL && tar -czf all.tgz two eight stdout_two.txt stdout_eight.txt && rm -rf two eight stdout_two.txt stdout_eight.txt
