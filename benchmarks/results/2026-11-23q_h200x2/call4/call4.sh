#!/usr/bin/env bash
# Call 4 (seventeenth session): main's candidate 675b826 (the direct dispatch by default at 2 ranks): the auto
# region and fallback tests, the bench with the reference (the checks' outputs freed before timing), and the
# Megatron MoE layer (forward and backward against alltoall) with the default config, then its layer bench.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=500 BENCH_TIMEOUT=90 MEGATRON_SM_COMBINE=0 MEGATRON_TEST_TIMEOUT=220 \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="auto_output_region or fall_back" \
  STAGES="build tests bench megatron" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log | tail -12
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
