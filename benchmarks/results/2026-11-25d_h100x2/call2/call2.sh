#!/usr/bin/env bash
# Call 2 (twenty-fourth session, 2 GPUs over NVLink), main at the notify-row-layout-check merge:
# (1) the rest of the intranode file (call 1 ran its multi-rank case sets, fallbacks and the row-layout test)
#     with the layout and output-region files, and the low-latency file's fp32-partials launch;
# (2) the timeout tests of the intranode and low-latency files (a peer that never answers, out-of-range ids,
#     ranks whose calls disagree: the low-latency layout tag, the intranode row layout);
# (3) if time is left: the phase-profile build, BF16 cached dispatch at 24 SMs (where the direct kernel's
#     time goes: handshake, rows, the last block's wait for the peers).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=470 BENCH_TIMEOUT=45 \
  PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_layout.py tests/test_output_region.py tests/test_native_low_latency.py" \
  PYTEST_K="(not multi_rank and not fall_back and not row_layout and not missing_peer and not out_of_range and not disagree and not test_native_low_latency) or fp32_partials" \
  HANG_RESERVE_S=170 TIMEOUTS_FILES="tests/test_native_intranode.py tests/test_native_low_latency.py" \
  STAGES="build tests timeouts" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
if [ $SECONDS -lt 440 ]; then
  OUT=$ALL/phase BENCH_TIMEOUT=40 EP_PLUGIN_NVCC_FLAGS="-DEP_PLUGIN_PHASE_PROFILE" VARIANTS=$'phase||\nphase_fp8||--dtype fp8' \
    BUDGET_S=$((560 - SECONDS)) STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_phase.txt 2>&1
fi
echo "##### summary"; grep -v "^variant" $ALL/c/summary.txt; cat $ALL/phase/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error\|error" $ALL/c/tests.log $ALL/c/timeouts.log 2>/dev/null | cut -c1-300 | tail -24
grep -h "^\[phase\]" $ALL/phase/bench.log 2>/dev/null | cut -c1-400 | tail -8
grep -h "^=== bench\|^verified\|^dispatch" $ALL/phase/bench.log 2>/dev/null | head -12
cd $ALL && tar -czf all.tgz c phase stdout*.txt 2>/dev/null; rm -rf c phase stdout*.txt
