#!/usr/bin/env bash
# Call 6 (eighteenth session): the Megatron GPU tests on main after the claimed-token change
# (the dispatcher takes the direct path by default at 2 ranks). No layer bench.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=230 MEGATRON_SM_COMBINE=0 MEGATRON_EXPERT_IMPLS=" " MEGATRON_TEST_TIMEOUT=150 \
  STAGES="build megatron" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | tail -6
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
