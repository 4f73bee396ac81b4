"""Intranode cases for compute-sanitizer, run by tests/test_native_memcheck.py:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \
        python3 tests/memcheck_rounds.py RANKS

Without torch's caching allocator every tensor is its own allocation, so memcheck reports any access
past a tensor's end (inside a cached segment such an access reads a neighbour's bytes unseen, and faults
only where the tensor happens to end its segment).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ep_plugin.launch import parallel_launch  # noqa: E402
from test_native_intranode import CASES, cases_rank, direct_output_bytes  # noqa: E402

# Token counts below notify's block of threads (256-500), so that its last warps have no token; top-k 9,
# FP8 rows, -1 routing entries and an empty rank.
NAMES = ("topk9", "fp8_hidden1536", "routing_minus_one", "empty_rank")


def rounds(ranks: int):
    """(what, combine_staging_tokens, dispatch_output_bytes, num_sms) of each round."""
    direct = direct_output_bytes(ranks)
    return (("ring dispatch, copy-engine combine (SM combine at 3-8 ranks)", 4096, 0, 24),
            ("ring dispatch, SM combine", 0, 0, 24),
            ("direct dispatch", 4096, direct, 24),
            ("direct dispatch at 8 SMs", 4096, direct, 8))


def main() -> None:
    ranks = int(sys.argv[1])
    in_order = [c["name"] for c in CASES if c["name"] in NAMES]  # cases_rank runs them in CASES order
    for what, staging, output_bytes, num_sms in rounds(ranks):
        done = parallel_launch(ranks, cases_rank, in_order, staging, output_bytes, 1, num_sms)
        print(f"memcheck rounds: {what}: {', '.join(done[0])} on {ranks} ranks")


if __name__ == "__main__":
    main()
