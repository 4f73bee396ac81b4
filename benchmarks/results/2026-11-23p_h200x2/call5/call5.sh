#!/usr/bin/env bash
# Call 5 (sixteenth session): main after the merge and the review (e3794bb: the bulk launch's shared-memory
# setup in one place): the ring and direct case tests, then one bench run of each path.
set -u
export MAX_JOBS=16
ALL=$OUT
D=.device/direct.yaml
VARIANTS="rings_bf16_24||
direct_bf16_24||--config $D" \
OUT=$ALL/c DEADLINE_S=400 HANG_RESERVE_S=0 BENCH_TIMEOUT=60 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="test_cases_multi_rank or direct_outputs" STAGES="build tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|error\|Error" $ALL/c/tests.log | tail -8
echo "##### bench"; grep -h "^ep_plugin bench\|^verified\|^dispatch\|^combine\|variant" $ALL/c/*.log | sed 's/.*results_dir.//' | head -30
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
