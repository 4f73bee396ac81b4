#!/usr/bin/env bash
# Call 3 (nineteenth session): main after merging combine-early-rows. The native intranode, layout and
# output-region test files in full, the timeout tests, the bench with the reference, and the Megatron
# GPU tests and layer bench (sequential experts).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=520 HANG_RESERVE_S=70 TIMEOUTS_FILES=tests/test_native_intranode.py BENCH_TIMEOUT=90 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_layout.py tests/test_output_region.py" \
  MEGATRON_EXPERT_IMPLS="sequential" MEGATRON_SM_COMBINE=0 \
  STAGES="build tests timeouts bench megatron" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log | tail -16
echo "##### bench"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
echo "##### megatron"; grep -h "ep_plugin\|deepep\|alltoall\|step\|us" $ALL/c/bench.log | grep -iv "^dispatch\|^combine\|^reference\|P2P\|verified" | tail -20
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
