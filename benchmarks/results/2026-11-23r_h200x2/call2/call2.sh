#!/usr/bin/env bash
# Call 2 (eighteenth session): the direct dispatch's warps claim chunks of tokens from a counter
# (EP_PLUGIN_DIRECT_CHUNK=N tokens per chunk; 0: the fixed equal shares of main). Diagnostic build
# (-DEP_PLUGIN_PHASE_PROFILE) so that the per-block finish times show the balance; every run is
# checked against the reference.
set -u
export MAX_JOBS=16 EP_PLUGIN_NVCC_FLAGS=-DEP_PLUGIN_PHASE_PROFILE
ALL=$OUT
VARIANTS="chunk0_bf16|EP_PLUGIN_DIRECT_CHUNK=0|
chunk1_bf16|EP_PLUGIN_DIRECT_CHUNK=1|
chunk2_bf16|EP_PLUGIN_DIRECT_CHUNK=2|
chunk4_bf16|EP_PLUGIN_DIRECT_CHUNK=4|
chunk0_fp8|EP_PLUGIN_DIRECT_CHUNK=0|--dtype fp8
chunk1_fp8|EP_PLUGIN_DIRECT_CHUNK=1|--dtype fp8
chunk2_fp8|EP_PLUGIN_DIRECT_CHUNK=2|--dtype fp8
chunk1_blocks24_bf16|EP_PLUGIN_DIRECT_CHUNK=1 EP_PLUGIN_DIRECT_MAX_BLOCKS=24|
chunk1_blocks24_fp8|EP_PLUGIN_DIRECT_CHUNK=1 EP_PLUGIN_DIRECT_MAX_BLOCKS=24|--dtype fp8
chunk1_blocks20_bf16|EP_PLUGIN_DIRECT_CHUNK=1 EP_PLUGIN_DIRECT_MAX_BLOCKS=20|
chunk1_bf16_again|EP_PLUGIN_DIRECT_CHUNK=1|
chunk0_bf16_again|EP_PLUGIN_DIRECT_CHUNK=0|
chunk1_norelaunch_bf16|EP_PLUGIN_DIRECT_CHUNK=1 EP_PLUGIN_DIRECT_DIAG=2|" \
OUT=$ALL/c DEADLINE_S=500 BENCH_TIMEOUT=60 STAGES="build variants" \
  bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
echo "##### bench"; grep -h "^=== bench\|^verified\|^dispatch\|^combine" $ALL/c/bench.log | sed 's/.*variant_//;s/.json.*//' | head -80
cd $ALL && tar -czf all.tgz c stdout.txt && rm -rf c stdout.txt
