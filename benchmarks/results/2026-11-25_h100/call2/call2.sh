#!/usr/bin/env bash
# Call 2 (twenty-second session, one GPU): call 1's 8-rank part again. Call 1 quit MPS without its pipe
# directory, so the daemon kept running and the 8-rank share stage could not start one: the low-latency
# file then skipped. Eight ranks sharing the GPU: the low-latency test file (issue 8; correctness only).
set -u
export MAX_JOBS=16
ALL=$OUT
CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe nvidia-cuda-mps-control <<< quit 2>/dev/null; sleep 2
OUT=$ALL/eight RANKS_PER_GPU=8 EP_TEST_RANKS=8 EP_TEST_MAX_SMS=12 DEADLINE_S=$((570 - SECONDS)) \
  PYTEST_ARGS="-v tests/test_native_low_latency.py" PYTEST_K="not missing_peer and not disagree" \
  STAGES="build share tests" bash benchmarks/gpu_session.sh > $ALL/stdout_eight.txt 2>&1
echo "##### eight: summary"; cat $ALL/eight/summary.txt
echo "##### eight: tests"; grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|timeout\|Timeout" $ALL/eight/tests.log | cut -c1-300 | tail -60
cd $ALL && tar -czf all.tgz eight stdout_eight.txt && rm -rf eight stdout_eight.txt
