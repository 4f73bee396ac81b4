#!/usr/bin/env bash
# Call 1 (twenty-sixth session, 2x H200): is the FP8 cached dispatch's bimodality (100 or 125 us) the host?
# The bench now reports the host's time per call beside the GPU's, and --gpu-lead-us queues a GPU sleep before each
# timed call so that the host runs ahead. Build, the bench (reference + P2P in the same run), then FP8 at 24 SMs
# four times as separate processes and twice with a 300 us lead, BF16 once with the lead; SM clocks logged.
set -u
export MAX_JOBS=16 CLOCK_LOG=1
ALL=$OUT
V="fp8_a||--dtype fp8 --iters 30
fp8_lead_a||--dtype fp8 --iters 30 --gpu-lead-us 300
fp8_b||--dtype fp8 --iters 30
fp8_c||--dtype fp8 --iters 30
fp8_lead_b||--dtype fp8 --iters 30 --gpu-lead-us 300
fp8_d||--dtype fp8 --iters 30
bf16_lead||--iters 30 --gpu-lead-us 300
fp8_16_lead||--dtype fp8 --num-sms 16 --iters 30 --gpu-lead-us 300"
OUT=$ALL/c BENCH_TIMEOUT=60 VARIANTS="$V" STAGES="build bench variants" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
grep -h "^=== bench\|^dispatch\|^combine\|^reference\|^P2P" $ALL/c/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150 | head -80
echo "##### clocks (SM MHz min/median/max per GPU, throttle reasons seen)"
python3 - "$ALL/c/clocks.log" <<'PY'
import sys, statistics, collections
clk = collections.defaultdict(list); why = collections.Counter()
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 7 or not f[2].split()[0].isdigit(): continue
    clk[f[1]].append(int(f[2].split()[0])); why[f[6]] += 1
for g, v in clk.items(): print(g, min(v), statistics.median(v), max(v), len(v))
print(why.most_common(6))
PY
cd $ALL && tar -czf all.tgz c stdout.txt 2>/dev/null; cp c/clocks.log c/bench.log c/summary.txt . ; rm -rf c stdout.txt
