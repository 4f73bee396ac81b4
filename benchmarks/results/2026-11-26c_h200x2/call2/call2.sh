#!/usr/bin/env bash
# Call 2 (twenty-seventh session, 2x H200, branch combine-lean-start): the copy-engine combine's sender side
# in the reduction kernel (staged_rows/base words and the top-k weights), the release wait queued at the end
# of the combine before, and the caller not waiting for the landed words' writes.
# (1) build; the intranode cases (every combine path, unlanded words), async, 1000 iterations; the combine's
#     missing-peer test; (2) A/B variants alternating (BF16, 24 SMs); (3) combine timelines, new and old.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=300 HANG_RESERVE_S=60 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="test_cases_multi_rank or 1000 or async or (missing_peer and combine)" \
  STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
OLD="EP_PLUGIN_COMBINE_SENDER=engine EP_PLUGIN_COMBINE_JOIN_SIGNALS=1"
VARIANTS="old|$OLD|
new||
a_nojoin|EP_PLUGIN_COMBINE_SENDER=engine|
ab_startwait|EP_PLUGIN_COMBINE_RELEASE_WAIT=start|
old2|$OLD|
new2||
a_nojoin2|EP_PLUGIN_COMBINE_SENDER=engine|
ab_startwait2|EP_PLUGIN_COMBINE_RELEASE_WAIT=start|
new16||--num-sms 16
old16|$OLD|--num-sms 16" OUT=$ALL/v BENCH_TIMEOUT=40 STAGES="variants" bash benchmarks/gpu_session.sh > $ALL/stdout_v.txt 2>&1
timeout 90 python3 benchmarks/combine_timeline.py --out-dir $ALL/tl_new > $ALL/tl_new.txt 2>&1
( export $OLD; timeout 90 python3 benchmarks/combine_timeline.py --out-dir $ALL/tl_old > $ALL/tl_old.txt 2>&1 )
echo "##### summary"; cat $ALL/c/summary.txt $ALL/v/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log 2>/dev/null | cut -c1-300 | tail -8
grep -h "^=== bench\|^combine\|^dispatch" $ALL/v/bench.log | sed 's/.*results_dir.//' | cut -c1-150
grep -A30 "^rank 0" $ALL/tl_new.txt | head -24; grep -A30 "^rank 0" $ALL/tl_old.txt | head -24
cd $ALL && tar -czf all.tgz c v tl_new tl_old *.txt 2>/dev/null; rm -rf c v tl_new tl_old stdout*.txt
