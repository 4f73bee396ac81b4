#!/usr/bin/env bash
# Call 1 (twenty-fourth session, 2 GPUs over NVLink), branch early-loads = main + notify-row-layout-check +
# the direct dispatch's first bulk loads issued before its start handshake:
# (1) tests: every multi-rank case set of the intranode file, the region-full fallbacks (a warp that loaded
#     ahead and then falls back) and the new row-layout test (the notify kernel changed);
# (2) the bench with the reference and the P2P ceiling (early loads on: the new default);
# (3) variants, BF16 and FP8 cached dispatch at 24 SMs, early loads off/on alternating.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=330 BENCH_TIMEOUT=45 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="multi_rank or fall_back or row_layout" \
  VARIANTS=$'off_a|EP_PLUGIN_DIRECT_EARLY_LOADS=0|\non_a||\noff_b|EP_PLUGIN_DIRECT_EARLY_LOADS=0|\non_b||\nfp8_off|EP_PLUGIN_DIRECT_EARLY_LOADS=0|--dtype fp8\nfp8_on||--dtype fp8' \
  BUDGET_S=540 STAGES="build tests bench variants" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; grep -v "^variant" $ALL/c/summary.txt
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log 2>/dev/null | cut -c1-250 | tail -14
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ --no-baseline --warmup 3 --iters 20//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -90
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
