#!/usr/bin/env bash
# Call 4 (twenty-first session, one H200): 8 ranks sharing the GPU under CUDA MPS (12% of it each,
# EP_TEST_MAX_SMS=12 so that every rank's ring blocks can be resident at once). A correctness run of
# the 8-rank intranode paths before an 8-GPU machine is lent (issue 8): the ring dispatch with the
# copy-engine combine at 8 ranks, the direct dispatch at 8 ranks, and the copy-engine dispatch rows at 8.
set -u
export MAX_JOBS=16
ALL=$OUT
T=tests/test_native_intranode.py
OUT=$ALL/c RANKS_PER_GPU=8 EP_TEST_RANKS=8 EP_TEST_MAX_SMS=12 TEST_TIMEOUT=420 \
  PYTEST_ARGS="-v $T::test_cases_multi_rank $T::test_cases_multi_rank_direct_outputs $T::test_cases_multi_rank_copy_engine_dispatch $T::test_cases_multi_rank_other_combine_paths" \
  STAGES="build share tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|Error\|timeout\|Timeout" $ALL/c/tests.log | cut -c1-400 | tail -40
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
