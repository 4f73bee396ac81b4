#!/usr/bin/env bash
# Call 1 (eighteenth session): where the direct dispatch's time goes. Diagnostic build
# (-DEP_PLUGIN_PHASE_PROFILE: per-block marks and per-warp cycles), then bench variants with
# EP_PLUGIN_DIRECT_DIAG bits (1 no scale/top-k stores, 2 no ring relaunch, 4 no own rows, 8 no peer rows,
# 16 interleaved tokens) and block counts.
set -u
export MAX_JOBS=16 EP_PLUGIN_NVCC_FLAGS=-DEP_PLUGIN_PHASE_PROFILE
ALL=$OUT
VARIANTS="base_bf16||
base_fp8||--dtype fp8
interleave_bf16|EP_PLUGIN_DIRECT_DIAG=16|
interleave_fp8|EP_PLUGIN_DIRECT_DIAG=16|--dtype fp8
norelaunch_bf16|EP_PLUGIN_DIRECT_DIAG=2|
nometa_bf16|EP_PLUGIN_DIRECT_DIAG=1|--no-check
nometa_fp8|EP_PLUGIN_DIRECT_DIAG=1|--dtype fp8 --no-check
peeronly_bf16|EP_PLUGIN_DIRECT_DIAG=4|--no-check
ownonly_bf16|EP_PLUGIN_DIRECT_DIAG=8|--no-check
blocks24_bf16|EP_PLUGIN_DIRECT_MAX_BLOCKS=24|
blocks8_bf16|EP_PLUGIN_DIRECT_MAX_BLOCKS=8|
peeronly_blocks24_bf16|EP_PLUGIN_DIRECT_DIAG=4 EP_PLUGIN_DIRECT_MAX_BLOCKS=24|--no-check
peeronly_blocks8_bf16|EP_PLUGIN_DIRECT_DIAG=4 EP_PLUGIN_DIRECT_MAX_BLOCKS=8|--no-check" \
OUT=$ALL/c DEADLINE_S=500 BENCH_TIMEOUT=60 STAGES="build variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### bench"; grep -h "^=== bench\|^dispatch\|^cached\|^combine" $ALL/c/bench.log | sed 's/.*variant_//;s/.json.*//' | head -80
echo "##### phase (rank 0, one per variant and op)"
grep -h "^=== bench\|\[phase\] direct" $ALL/c/bench.log | sed 's/.*variant_//;s/.json.*//' | awk '/^[a-z]/{v=$0; n=0; print v; next} /rank 0/{n++; if (n<=4) print}' | cut -c1-400
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
