#!/usr/bin/env bash
# Call 1 (twenty-third session, 2 GPUs over NVLink). Own-row blocks for the direct dispatch
# (EP_PLUGIN_DIRECT_OWN_BLOCKS: the last N blocks copy this rank's own rows, through registers unless
# EP_PLUGIN_DIRECT_OWN_BULK=1; the blocks before them store only the peers' rows; each role's warps then
# help the other). (1) The direct dispatch's tests (every case set; the new own-row parametrizations).
# (2) Variants: cached dispatch, 4096 x 7168, top-8 of 256 experts, each run verified against the reference.
# (3) The 4 x 3584 bulk pipeline build with the best own-row settings.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/main DEADLINE_S=200 BENCH_TIMEOUT=40 PYTEST_ARGS="-v tests/test_native_intranode.py" PYTEST_K="direct_outputs" \
  VARIANTS=$'main||\nown8|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|\nown6|EP_PLUGIN_DIRECT_OWN_BLOCKS=6|\nown10|EP_PLUGIN_DIRECT_OWN_BLOCKS=10|\nown12|EP_PLUGIN_DIRECT_OWN_BLOCKS=12|\nown8_bulk|EP_PLUGIN_DIRECT_OWN_BLOCKS=8 EP_PLUGIN_DIRECT_OWN_BULK=1|\nown8_peer12|EP_PLUGIN_DIRECT_OWN_BLOCKS=8 EP_PLUGIN_DIRECT_MAX_BLOCKS=12|\nmain_sms16||--num-sms 16\nown6_sms16|EP_PLUGIN_DIRECT_OWN_BLOCKS=6|--num-sms 16\nown8_sms16|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|--num-sms 16\nmain_fp8||--dtype fp8\nown8_fp8|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|--dtype fp8' \
  STAGES="build tests variants" bash benchmarks/gpu_session.sh > $ALL/stdout_main.txt 2>&1
OUT=$ALL/pipe4x3584 BENCH_TIMEOUT=40 EP_PLUGIN_NVCC_FLAGS="-DEP_PLUGIN_BULK_STAGES=4 -DEP_PLUGIN_BULK_PIECE_BYTES=3584" \
  VARIANTS=$'main||\nown8|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|\nown8_bulk|EP_PLUGIN_DIRECT_OWN_BLOCKS=8 EP_PLUGIN_DIRECT_OWN_BULK=1|\nown8_sms16|EP_PLUGIN_DIRECT_OWN_BLOCKS=8|--num-sms 16' \
  BUDGET_S=$((540 - SECONDS)) STAGES="build variants" bash benchmarks/gpu_session.sh > $ALL/stdout_pipe.txt 2>&1
for d in main pipe4x3584; do
  echo "##### $d: summary"; grep -v "^variant" $ALL/$d/summary.txt
  grep -h "PASSED\|FAILED\|ERROR\|passed\|failed" $ALL/$d/tests.log 2>/dev/null | cut -c1-250 | tail -14
  grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine" $ALL/$d/bench.log | sed 's/.*results_dir.//; s/ --num-sms 24 --dtype bf16 --no-baseline --warmup 3 --iters 20//; s/ (1 GiB into the next GPU, all ranks at once)//' | head -80
done
cd $ALL && tar -czf all.tgz main pipe4x3584 stdout_*.txt && rm -rf main pipe4x3584 stdout_*.txt
