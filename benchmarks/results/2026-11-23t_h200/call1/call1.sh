#!/usr/bin/env bash
# Call 1 (twentieth session, one H200: no 2-GPU kind lent). The stream-wait probe on one GPU; then two
# ranks sharing the GPU under MPS: the intranode case tests (the new combine sender variants
# included) and one bench run per sender variant (timings of shared-GPU ranks, not NVLink).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=560 BENCH_RANKS=2 BENCH_TIMEOUT=100 \
  PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="(test_cases_multi_rank and not register and not chunks) or test_cases_one_rank or 1000_back" \
  VARIANTS=$'main||\ncopy_first|EP_PLUGIN_COMBINE_COPY_FIRST=1|\nstream_wait|EP_PLUGIN_COMBINE_STREAM_WAIT=1|\nboth|EP_PLUGIN_COMBINE_COPY_FIRST=1 EP_PLUGIN_COMBINE_STREAM_WAIT=1|\nmain_again||' \
  STAGES="build waitprobe share tests variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### probe"; grep -v "^===" $ALL/c/probe.log | tail -12
echo "##### tests"; grep -h "passed\|failed\|FAILED\|Error\|SKIPPED" $ALL/c/tests.log | tail -20
echo "##### variants"; grep -h "^=== bench\|^P2P\|^verified\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//' | head -60
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
