#!/usr/bin/env bash
# Call 2 (twentieth session, one H200: no 2-GPU kind lent). Call 1's probe hung (lazy kernel loading
# behind a spinning kernel; fixed: kernels loaded up front, every spin gives up after 2 s). The probe
# on one GPU; then two ranks sharing the GPU under MPS: the intranode case tests (the combine sender
# variants included) and one bench run per sender variant (shared-GPU timings, not NVLink).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=545 HANG_RESERVE_S=150 BENCH_RANKS=2 BENCH_TIMEOUT=60 WAIT_PROBE_TIMEOUT=40 \
  PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank_combine_sender_variants or test_cases_multi_rank_other or (test_cases_multi_rank and not register and not direct) or test_cases_one_rank or 1000_back" \
  VARIANTS=$'main||\nboth|EP_PLUGIN_COMBINE_COPY_FIRST=1 EP_PLUGIN_COMBINE_STREAM_WAIT=1|\nmain_again||' \
  STAGES="build waitprobe share tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### probe"; grep -v "^===" $ALL/c/probe.log | tail -12
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error\|SKIPPED" $ALL/c/tests.log | tail -20
echo "##### variants"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -40
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
