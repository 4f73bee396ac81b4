#!/usr/bin/env bash
# Call 6 (twenty-ninth session, 4x H200): the SM combine's default rings at 3-8 ranks become 2 / 64
# (combine.nvl_chunked_send_tokens / nvl_chunked_recv_tokens; call 5: 784.0 against 961.5 us at 4 ranks).
# (1) build; at 4 ranks, the intranode tests whose combine runs on the SMs with the default rings (sm_combine,
#     auto_staging), the auto output region's cases, and the internode file's 4-GPU tests (2 x 2 uses the default
#     combine config at 4 ranks too); (2) `ep-plugin bench` at 4 ranks, BF16 / FP8 x 24 / 16 SMs, the reference and
#     the P2P ceiling in the same run.
set -u
export MAX_JOBS=16 EP_TEST_RANKS=4 BENCH_RANKS=4
ALL=$OUT
OUT=$ALL/t DEADLINE_S=200 PYTEST_ARGS="tests/test_native_intranode.py" \
  PYTEST_K="sm_combine or auto_staging or auto_output_region" STAGES="build tests" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
timeout 90 python3 -m pytest -q tests/test_native_internode.py -k "four_ranks or two_nodes_of_two" > $ALL/internode4.log 2>&1
OUT=$ALL/b BENCH_TIMEOUT=45 BUDGET_S=$((330 - SECONDS)) STAGES="bench" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/t/summary.txt $ALL/b/summary.txt 2>/dev/null
grep -h "passed\|failed\|FAILED\|timeout in\|Error" $ALL/t/tests.log $ALL/internode4.log 2>/dev/null | cut -c1-300 | tail -10
grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $ALL/b/bench.log 2>/dev/null | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150
cd $ALL && tar -czf all.tgz t b stdout.txt internode4.log 2>/dev/null; rm -rf t b stdout.txt internode4.log
