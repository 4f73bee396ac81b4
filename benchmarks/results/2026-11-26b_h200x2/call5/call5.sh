#!/usr/bin/env bash
# Call 5 (twenty-sixth session, 2x H200), branch combine-weights-by-kernel: the copy-engine combine's top-k weights
# are stored by the release wait's kernel (512 threads) instead of a copy-engine copy between that wait and the
# rows (EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine: the code before). Build; the combine's case tests; A/B bench runs
# alternating; the full bench (reference + P2P ceiling); then, for the host-path change on main, the low-latency
# file and the internode file (emulated nodes), their trapping tests left out.
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/t DEADLINE_S=$((200 - SECONDS)) PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank_other_combine_paths or (test_cases_multi_rank and not direct and not register and not copy_engine)" \
  STAGES="tests" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
V="kernel_a||
engine_a|EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine|
kernel_b||
engine_b|EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine|
kernel_c||
engine_c|EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine|
kernel_16||--num-sms 16
engine_16|EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine|--num-sms 16"
OUT=$ALL/v BENCH_TIMEOUT=60 VARIANTS="$V" BUDGET_S=$((300 - SECONDS)) STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/b BENCH_TIMEOUT=60 BUDGET_S=$((360 - SECONDS)) STAGES="bench" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
mkdir -p $ALL/l; [ $SECONDS -lt 380 ] && timeout -k 10 $((520 - SECONDS)) python3 -m pytest -q -rs --durations=5 \
  tests/test_native_low_latency.py -k "not missing_peer and not disagree" > $ALL/l/tests.log 2>&1
echo "ll tests: rc=$?, at $SECONDS s" > $ALL/l/summary.txt
OUT=$ALL/i DEADLINE_S=$((565 - SECONDS)) PYTEST_ARGS="tests/test_native_internode.py" PYTEST_K="not missing_peer and not disagree and not out_of_range" \
  BUDGET_S=$((520 - SECONDS)) STAGES="tests" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt $ALL/v/summary.txt $ALL/b/summary.txt $ALL/l/summary.txt $ALL/i/summary.txt 2>/dev/null
for d in t l i; do grep -h "passed\|failed\|FAILED\|timeout in" $ALL/$d/tests.log 2>/dev/null | cut -c1-300 | tail -4; done
grep -h "^=== bench\|^dispatch_cached\|^combine\|^P2P\|^reference" $ALL/v/bench.log $ALL/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
cd $ALL && tar -czf all.tgz c t v b l i stdout.txt 2>/dev/null; for d in t l i; do cp $d/tests.log tests_$d.log 2>/dev/null; done; rm -rf c t v b l i stdout.txt
