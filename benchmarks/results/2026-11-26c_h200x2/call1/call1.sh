#!/usr/bin/env bash
# Call 1 (twenty-seventh session, 2x H200, main at e8601ff + benchmarks/combine_timeline.py):
# (1) build; the Buffer call made while another GPU is current (374fdb4) and the combine cases;
#     the host's time per call (a6492e8); the timeout/disagreement tests of the three native files;
# (2) benchmarks/combine_timeline.py: every GPU operation of the combine on both ranks (24 and 16 SMs).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c DEADLINE_S=470 HANG_RESERVE_S=170 HOST_TOKENS="128 4096" \
  PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="another_gpu or combine" \
  STAGES="build tests host" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
for sms in 24 16; do
  timeout 120 python3 benchmarks/combine_timeline.py --num-sms $sms --out-dir $ALL/tl$sms > $ALL/tl$sms.txt 2>&1
done
OUT=$ALL/t DEADLINE_S=$((585 - SECONDS)) TIMEOUTS_TEST_TIMEOUT=90 STAGES="timeouts" \
  bash benchmarks/gpu_session.sh > $ALL/stdout_t.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/c/tests.log $ALL/t/timeouts.log 2>/dev/null | cut -c1-300 | tail -14
grep -h -A2 "^host us per call" $ALL/c/host.log 2>/dev/null | cut -c1-200
cat $ALL/tl24.txt | tail -32; cat $ALL/tl16.txt | tail -32
cd $ALL && tar -czf all.tgz c t tl24 tl16 *.txt 2>/dev/null; rm -rf c t tl24 tl16 stdout*.txt
