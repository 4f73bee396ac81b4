#!/usr/bin/env bash
# Call 5 (twenty-fifth session, 2x H200 over NVLink), branch combine-copies-first: the copy-engine combine queues
# its copies before it launches the owner's reduction (EP_PLUGIN_COMBINE_LAUNCH=reduce gives the code before):
# (1) build; variants, BF16 at 24 SMs (and 16), the two orders interleaved;
# (2) the bench with the reference and the P2P ceiling in the same run; the torch.profiler timelines (their step table
#     now read from the trace: host time and the GPU span of each step);
# (3) every multi-rank case set of the intranode file, the back-to-back and event tests.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c BENCH_TIMEOUT=45 \
  VARIANTS=$'copies_a||\nreduce_a|EP_PLUGIN_COMBINE_LAUNCH=reduce|\ncopies_b||\nreduce_b|EP_PLUGIN_COMBINE_LAUNCH=reduce|\ncopies_16||--num-sms 16\nreduce_16|EP_PLUGIN_COMBINE_LAUNCH=reduce|--num-sms 16' \
  PROFILE_TIMEOUT=100 STAGES="build variants bench timeline" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OUT=$ALL/t DEADLINE_S=$((560 - SECONDS)) PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="multi_rank or back_to_back or event or async" \
  STAGES="tests" bash benchmarks/gpu_session.sh > $ALL/stdout_t.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/t/tests.log 2>/dev/null | cut -c1-300 | tail -12
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150 | head -80
grep -v "^ep_plugin env\|UserWarning\|_warn_once" $ALL/c/profile.log | grep -A5 "^rank . (native)" | cut -c1-120
cd $ALL && tar -czf all.tgz c t stdout*.txt 2>/dev/null; rm -rf c t stdout*.txt
