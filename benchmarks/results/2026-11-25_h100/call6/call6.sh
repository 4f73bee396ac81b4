#!/usr/bin/env bash
# Call 6 (twenty-second session, one GPU). Call 5: at 8 ranks sharing the GPU (MPS) every low-latency case up to
# cuda_graph_1000_replays passed on every rank; that case's 1000 replays, each checked against the reference
# over gloo at 8 ranks, outlasted the launch's 200 s, so the route_* cases after it never ran. Here: those.
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/eight RANKS_PER_GPU=8 STAGES="build share" bash benchmarks/gpu_session.sh > $ALL/stdout_eight.txt 2>&1
export EP_PLUGIN_RANKS_PER_GPU=8 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=12 CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cat $ALL/eight/summary.txt
cd tests && timeout -k 5 240 python3 - <<'PY' 2>&1 | grep -v "^ep_plugin env" | tail -30 | tee $ALL/route8.txt
import random
from ep_plugin.launch import parallel_launch
import test_native_low_latency as t
names = [n for n in t.CASE_NAMES if n.startswith("route_") and "cuda_graph" not in n]
seed = random.SystemRandom().randrange(1 << 30)
results = parallel_launch(8, t.low_latency_worker, seed, "bf16", names, timeout_s=170)
for name in names:
    failed = [r for r, res in enumerate(results) if res[name]]
    print(f"{name}: {'passed on 8 ranks' if not failed else 'FAILED on ranks ' + str(failed)}")
    for r in failed[:1]:
        print(results[r][name][-1500:])
print(f"seed {seed}: {sum(not res[n] for res in results for n in names)} of {8 * len(names)} rank-cases passed")
PY
