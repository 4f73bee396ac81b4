#!/usr/bin/env bash
# Call 3 (twenty-third session, 2 GPUs over NVLink), the 4 x 3584 bulk pipeline as the default: (1) the rest of
# the intranode file (the one-rank, region, fallback and input-check tests; call 2 ran every multi-rank case
# set), then its timeout tests (a peer that never answers, out-of-range ids); (2) the direct dispatch's block
# cap and chunk size with the new pipeline, BF16 cached dispatch at 24 SMs, each run verified against the reference.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=330 BENCH_TIMEOUT=40 PYTEST_ARGS="tests/test_native_intranode.py tests/test_native_layout.py tests/test_output_region.py" \
  PYTEST_K="not multi_rank and not missing_peer and not out_of_range and not disagree" \
  TIMEOUTS_FILES="tests/test_native_intranode.py" \
  VARIANTS=$'main||\nblocks12|EP_PLUGIN_DIRECT_MAX_BLOCKS=12|\nblocks14|EP_PLUGIN_DIRECT_MAX_BLOCKS=14|\nblocks20|EP_PLUGIN_DIRECT_MAX_BLOCKS=20|\nblocks10|EP_PLUGIN_DIRECT_MAX_BLOCKS=10|\nchunk2|EP_PLUGIN_DIRECT_CHUNK=2|' \
  STAGES="build tests timeouts variants" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; grep -v "^variant" $ALL/c/summary.txt
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/c/timeouts.log 2>/dev/null | cut -c1-250 | tail -14
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ --num-sms 24 --dtype bf16 --no-baseline --warmup 3 --iters 20//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -60
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
