#!/usr/bin/env bash
# Call 5 (twenty-second session, one GPU). Call 4 found the 8-rank fault's cause: a test defect. The case
# fewer_tokens_than_t_max gave rank r 37 + 20 r tokens, past T_max = 128 from rank 5 on; those ranks raised
# before their dispatch (correctly) and went on to the next case, whose dispatch then met the other ranks'
# dispatch of a different T_max (an illegal memory access). The case now stays within T_max at any rank
# count (route_fewer_tokens_small_t_max too). Here: the low-latency file at 8 ranks sharing the GPU (MPS).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/eight RANKS_PER_GPU=8 EP_TEST_RANKS=8 EP_TEST_TRACE_CASES=1 DEADLINE_S=$((540 - SECONDS)) \
  PYTEST_ARGS="-v tests/test_native_low_latency.py" PYTEST_K="not missing_peer and not disagree" \
  STAGES="build share tests" bash benchmarks/gpu_session.sh > $ALL/stdout_eight.txt 2>&1
echo "##### eight: summary"; cat $ALL/eight/summary.txt
echo "##### eight: failing cases"; grep -h "case_runner: pid" $ALL/eight/tests.log | grep -v "starting\|: passed" | cut -c1-300 | head -30
echo "##### eight: cases passed (all ranks, both launches)"; grep -h "case_runner: pid" $ALL/eight/tests.log | grep -c ": passed"
echo "##### eight: tests"; grep -h "PASSED\|FAILED\|ERROR\|passed\|failed" $ALL/eight/tests.log | grep -v case_runner | cut -c1-200 | tail -12
cd $ALL && tar -czf all.tgz eight stdout_eight.txt && rm -rf eight stdout_eight.txt
