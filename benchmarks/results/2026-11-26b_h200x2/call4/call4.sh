#!/usr/bin/env bash
# Call 4 (twenty-sixth session, 2x H200), branch combine-weights-aside: the copy-engine combine's top-k weights
# copy moves from before the rows (copy stream) to the signal stream beside them, with its own landed word.
# Build; the combine's case tests; then A/B bench runs alternating (BF16, 24 SMs), switch off = the code before;
# then the full bench (reference + P2P ceiling in the same run).
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/t DEADLINE_S=$((250 - SECONDS)) PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank_other_combine_paths or (test_cases_multi_rank and not direct and not register and not copy_engine)" \
  STAGES="tests" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
V="aside_a||
before_a|EP_PLUGIN_COMBINE_WEIGHTS_ASIDE=0|
aside_b||
before_b|EP_PLUGIN_COMBINE_WEIGHTS_ASIDE=0|
aside_c||
before_c|EP_PLUGIN_COMBINE_WEIGHTS_ASIDE=0|
aside_16||--num-sms 16
before_16|EP_PLUGIN_COMBINE_WEIGHTS_ASIDE=0|--num-sms 16"
OUT=$ALL/v BENCH_TIMEOUT=60 VARIANTS="$V" BUDGET_S=$((470 - SECONDS)) STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/b BENCH_TIMEOUT=60 BUDGET_S=$((520 - SECONDS)) STAGES="bench" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt $ALL/v/summary.txt $ALL/b/summary.txt
grep -h "passed\|failed\|FAILED\|Error\|timeout in" $ALL/t/tests.log | cut -c1-300 | tail -8
grep -h "^=== bench\|^dispatch_cached\|^combine\|^P2P\|^reference" $ALL/v/bench.log $ALL/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
cd $ALL && tar -czf all.tgz c t v b stdout.txt 2>/dev/null; cp t/tests.log tests.log; rm -rf c t v b stdout.txt
