"""Call 6/7 (twenty-second session): the low-latency route_* cases (not the CUDA-graph one) at 8 ranks sharing one GPU
under MPS, run from tests/ (spawned ranks import this file, so it is a file, not standard input)."""
import random
import sys

from ep_plugin.launch import parallel_launch
import test_native_low_latency as t

if __name__ == "__main__":
    names = [n for n in t.CASE_NAMES if n.startswith("route_") and "cuda_graph" not in n]
    seed = random.SystemRandom().randrange(1 << 30)
    results = parallel_launch(8, t.low_latency_worker, seed, "bf16", names, timeout_s=170)
    for name in names:
        failed = [r for r, res in enumerate(results) if res[name]]
        print(f"{name}: {'passed on 8 ranks' if not failed else 'FAILED on ranks ' + str(failed)}")
        for r in failed[:1]:
            print(results[r][name][-1500:])
    print(f"seed {seed}: {sum(not res[n] for res in results for n in names)} of {8 * len(names)} rank-cases passed")
    sys.exit(0)
