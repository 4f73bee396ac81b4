#!/usr/bin/env bash
# Call 2 (twenty-third session, 2 GPUs over NVLink). The bulk-copy pipeline of 4 pieces of 3584 bytes per warp
# (2 loads ahead) as the default, against the old 8 x 1792 (6 ahead) in the same call: (1) the new default:
# every multi-rank case set of the intranode file (ring and direct dispatch both copy rows through the
# pipeline), then the bench with the reference and the P2P ceiling; (2) the old shape's build: the same four
# bench configurations without the reference.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/new DEADLINE_S=330 BENCH_TIMEOUT=60 PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="multi_rank" \
  STAGES="build tests bench" bash benchmarks/gpu_session.sh > $ALL/stdout_new.txt 2>&1
OUT=$ALL/old BENCH_TIMEOUT=40 EP_PLUGIN_NVCC_FLAGS="-DEP_PLUGIN_BULK_STAGES=8 -DEP_PLUGIN_BULK_PIECE_BYTES=1792" \
  VARIANTS=$'bf16_sms24||\nfp8_sms24||--dtype fp8\nbf16_sms16||--num-sms 16\nfp8_sms16||--dtype fp8 --num-sms 16' \
  BUDGET_S=$((545 - SECONDS)) STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_old.txt 2>&1
for d in new old; do
  echo "##### $d: summary"; grep -v "^variant" $ALL/$d/summary.txt
  grep -h "passed\|failed\|FAILED\|Error" $ALL/$d/tests.log 2>/dev/null | cut -c1-250 | tail -14
  grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/$d/bench.log | sed 's/.*results_dir.//; s/ --no-baseline --warmup 3 --iters 20//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -80
done
cd $ALL && tar -czf all.tgz new old stdout_*.txt && rm -rf new old stdout_*.txt
