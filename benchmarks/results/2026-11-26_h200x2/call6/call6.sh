#!/usr/bin/env bash
# Call 6 (twenty-fifth session, 2x H200 over NVLink), main at 9b25ae3 (the copies-first combine merged, the fixed
# profile_timeline): build, the bench (BF16/FP8 x 24/16 SMs, reference and P2P ceiling in the same run), the
# timelines, and the intranode multi-rank case sets while time is left.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c BENCH_TIMEOUT=45 PROFILE_TIMEOUT=60 STAGES="build bench timeline" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
if [ $SECONDS -lt 200 ]; then
  OUT=$ALL/t DEADLINE_S=$((285 - SECONDS)) PYTEST_ARGS="tests/test_native_intranode.py" PYTEST_K="test_cases_multi_rank" \
    STAGES="tests" bash benchmarks/gpu_session.sh > $ALL/stdout_t.txt 2>&1
fi
echo "##### summary"; cat $ALL/c/summary.txt $ALL/t/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|Error" $ALL/t/tests.log 2>/dev/null | cut -c1-300 | tail -6
grep -h "^=== bench\|^verified\|^P2P\|^dispatch\|^combine\|^reference" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150 | head -60
grep -v "^ep_plugin env\|UserWarning\|_warn_once" $ALL/c/profile.log | grep -A5 "^rank . (native)" | cut -c1-120
cd $ALL && tar -czf all.tgz c t stdout*.txt 2>/dev/null; rm -rf c t stdout*.txt
