#!/usr/bin/env bash
# Call 4 (twenty-seventh session, 2x H200, branch combine-lean-start + the reduction's overlapped loads):
# NOTE (after the call): pick.py looked in $ALL/v/results_dir, which gpu_session.sh had already packed into
# results.tgz, so it found no runs and the bench fell back to mode 2, the default (pick.txt).
# (1) build; the intranode combine cases (every combine path) with the default (EP_PLUGIN_COMBINE_OVERLAP=2) and
#     the cases again with mode 1; (2) A/B variants alternating: overlap modes 2/1/0 at 16 SMs (twice each),
#     2 and 1 at 24 SMs; (3) the bench (BF16/FP8 x 24/16 SMs, reference + P2P in the same run) with the mode
#     whose 16-SM combine was fastest (pick.py; the mode is printed in the summary).
set -u
export MAX_JOBS=16
ALL=$OUT
HERE=benchmarks/results/2026-11-26c_h200x2/call4
OUT=$ALL/c DEADLINE_S=150 HANG_RESERVE_S=0 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank and not chunks and not copy_engine_dispatch and not register and not direct_outputs and not auto" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
( export EP_PLUGIN_COMBINE_OVERLAP=1; timeout 40 python3 -m pytest -q tests/test_native_intranode.py -k "test_cases_multi_rank and not chunks and not copy_engine_dispatch and not register and not direct_outputs and not auto and not other" > $ALL/tests_mode1.log 2>&1 )
VARIANTS="o2_16a||--num-sms 16
o1_16a|EP_PLUGIN_COMBINE_OVERLAP=1|--num-sms 16
o0_16a|EP_PLUGIN_COMBINE_OVERLAP=0|--num-sms 16
o2_16b||--num-sms 16
o1_16b|EP_PLUGIN_COMBINE_OVERLAP=1|--num-sms 16
o0_16b|EP_PLUGIN_COMBINE_OVERLAP=0|--num-sms 16
o2_24||
o1_24|EP_PLUGIN_COMBINE_OVERLAP=1|" OUT=$ALL/v BENCH_TIMEOUT=30 STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/stdout_v.txt 2>&1
MODE=$(python3 $HERE/pick.py $ALL/v/results_dir 2> $ALL/pick.txt || echo 2)
echo "bench with EP_PLUGIN_COMBINE_OVERLAP=$MODE" >> $ALL/pick.txt
( export EP_PLUGIN_COMBINE_OVERLAP=$MODE; OUT=$ALL/b BENCH_TIMEOUT=45 STAGES="bench" bash benchmarks/gpu_session.sh > $ALL/stdout_b.txt 2>&1 )
echo "##### summary"; cat $ALL/c/summary.txt $ALL/v/summary.txt $ALL/b/summary.txt 2>/dev/null | grep -v "^bench: rc=0"
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/tests_mode1.log 2>/dev/null | cut -c1-300 | tail -8
cat $ALL/pick.txt
grep -h "^=== bench\|^combine" $ALL/v/bench.log | sed 's/.*results_dir.//; s/ --dtype bf16 --no-baseline --warmup 3 --iters 20//' | cut -c1-150
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
cd $ALL && tar -czf all.tgz c v b *.txt *.log 2>/dev/null; rm -rf c v b stdout*.txt
