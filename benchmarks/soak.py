"""Soak: many dispatch + combine rounds of random shapes, checked against the reference backend, and
Buffer create/destroy cycles, with GPU memory before and after (no growth expected).

Each iteration draws (from a seed every rank shares) the mode, the tokens of each rank (0 on some),
the hidden size and a routing skew; each rank's data and top-k ids (with -1 entries) come from its
own seed. Every `--check-every` iterations the same inputs also go through reference Buffers and the
results must agree: routing and copied rows exactly, sums within bf16 tolerance. On GPUs every
`--graph-every`-th low-latency round is a CUDA-graph replay (dispatch + combine captured once).

    python3 benchmarks/soak.py --iters 10000 --cycles 100            # GPU machine, one rank per GPU
    python3 benchmarks/soak.py --iters 40 --cycles 3 --check-every 10  # CPU, reference backend
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's ep_plugin first
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ep_plugin  # noqa: E402
from ep_plugin.launch import parallel_launch, rank_device  # noqa: E402
from ep_plugin.testing import raw_bytes  # noqa: E402

HIDDENS = (256, 512, 2048, 7168)
T_MAX, K, LOCAL_EXPERTS = 64, 4, 4
PROGRESS_EVERY = 1000  # iterations between rank 0's progress lines


def make_buffer(group, backend: str, low_latency: bool, timeout_s: float, explicitly_destroy: bool = False):
    R = group.size()
    config = {"backend": backend, "timeout_s": timeout_s}
    if low_latency:
        rdma = ep_plugin.Buffer.get_low_latency_rdma_size_hint(T_MAX, max(HIDDENS), R, LOCAL_EXPERTS * R)
        return ep_plugin.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=explicitly_destroy,
                                config=config)
    hidden_bytes = max(HIDDENS) * 2
    nvl = max(ep_plugin.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R),
              ep_plugin.Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden_bytes, R))
    return ep_plugin.Buffer(group, nvl, 0, explicitly_destroy=explicitly_destroy, config=config)


def draw(i: int, rank: int, R: int, seed: int, device):
    """Iteration i's mode, hidden and this rank's (x, topk_idx, weights)."""
    shared = random.Random(seed * 1_000_003 + i)
    low_latency = shared.random() < 0.5
    hidden = shared.choice(HIDDENS)
    skew = shared.choice((0.0, 1.0, 4.0))  # uneven routing: experts of low ranks drawn more often
    empty = shared.random() < 0.2 and rank == shared.randrange(R)  # 0 tokens on one rank
    own = torch.Generator().manual_seed(seed * 7919 + i * 131 + rank)
    num_tokens = 0 if empty else int(torch.randint(1, T_MAX + 1, (1,), generator=own))
    num_experts = LOCAL_EXPERTS * R
    bias = torch.exp(-skew * torch.arange(num_experts, dtype=torch.float32) / num_experts)
    ids = torch.stack([torch.multinomial(bias, K, generator=own) for _ in range(num_tokens)]) if num_tokens \
        else torch.empty(0, K, dtype=torch.int64)
    ids[torch.rand(ids.shape, generator=own) < 0.1] = -1
    x = torch.randn(num_tokens, hidden, generator=own).to(torch.bfloat16)
    weights = torch.rand(num_tokens, K, generator=own)
    return low_latency, x.to(device), ids.to(device), weights.to(device)


def normal_round(buffer, x, ids, weights, num_experts: int):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
    recv_x, recv_ids, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                             num_tokens_per_expert=per_expert, topk_idx=ids,
                                                             topk_weights=weights)
    combined, _, _ = buffer.combine(recv_x, handle)
    return [recv_x, recv_ids, recv_w], combined


def low_latency_pair(buffer, x, ids, weights, num_experts: int):
    """Dispatch + combine, nothing read back to the host (a CUDA graph captures it)."""
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, ids, T_MAX, num_experts, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv_x, ids, weights, handle)
    return recv_x, count, combined


def low_latency_round(buffer, x, ids, weights, num_experts: int):
    recv_x, count, combined = low_latency_pair(buffer, x, ids, weights, num_experts)
    valid = [recv_x[e, :n] for e, n in enumerate(count.tolist())]
    return [count] + valid, combined


def compare(got, want, what: str) -> None:
    got_rows, got_sum = got
    want_rows, want_sum = want
    for a, b in zip(got_rows, want_rows):
        if not torch.equal(raw_bytes(a.cpu()), raw_bytes(b.cpu())):
            raise AssertionError(f"{what}: routed rows differ from the reference")
    torch.testing.assert_close(got_sum.float().cpu(), want_sum.float().cpu(), rtol=2e-2, atol=2e-2)


class GraphRound:
    """A low-latency dispatch + combine of T_MAX tokens at hidden H captured once (GPU only)."""

    def __init__(self, buffer, R: int, device, hidden: int = 2048) -> None:
        self.num_experts = LOCAL_EXPERTS * R
        self.x = torch.zeros(T_MAX, hidden, dtype=torch.bfloat16, device=device)
        self.ids = torch.full((T_MAX, K), -1, dtype=torch.int64, device=device)
        self.weights = torch.zeros(T_MAX, K, device=device)

        def step():
            return low_latency_pair(buffer, self.x, self.ids, self.weights, self.num_experts)[2]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.combined = step()

    def replay(self, x, ids, weights):
        """Replay with T_MAX tokens from (x, ids, weights) (rows past theirs route nowhere)."""
        self.x.zero_()
        self.ids.fill_(-1)
        self.weights.zero_()
        n, h = x.size(0), min(x.size(1), self.x.size(1))
        self.x[:n, :h] = x[:, :h]
        self.ids[:n] = ids
        self.weights[:n] = weights
        self.combined.fill_(float("nan"))
        self.graph.replay()
        return self.combined


def memory(device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "device_used": total - free}


def soak_rank(rank: int, R: int, group, args: dict) -> dict:
    device = rank_device(rank)
    num_experts = LOCAL_EXPERTS * R
    started = time.monotonic()
    before = memory(device)
    buffers = {m: make_buffer(group, args["backend"], m, args["timeout_s"]) for m in (False, True)}
    references = {m: make_buffer(group, "reference", m, args["timeout_s"]) for m in (False, True)}
    graph = None
    if device.type == "cuda" and args["graph_every"] > 0 and args["backend"] == "native":
        graph_buffer = make_buffer(group, args["backend"], True, args["timeout_s"])
        graph = GraphRound(graph_buffer, R, device)
    counts = {"normal": 0, "low_latency": 0, "graph_replays": 0, "checks": 0}
    for i in range(args["iters"]):
        low_latency, x, ids, weights = draw(i, rank, R, args["seed"], device)
        check = (i + 1) % args["check_every"] == 0
        replay = graph is not None and low_latency and i % args["graph_every"] == 0
        if replay:
            width = graph.x.size(1)  # the captured hidden size: cut or zero-pad the rows to it
            x = torch.nn.functional.pad(x[:, :width], (0, width - min(x.size(1), width)))
            combined = graph.replay(x, ids, weights).clone()
            counts["graph_replays"] += 1
            if check:
                want = low_latency_round(references[True], x, ids, weights, num_experts)[1]
                torch.testing.assert_close(combined[:x.size(0)].float().cpu(), want.float().cpu(), rtol=2e-2,
                                           atol=2e-2)
        else:
            run = low_latency_round if low_latency else normal_round
            got = run(buffers[low_latency], x, ids, weights, num_experts)
            if check:
                compare(got, run(references[low_latency], x, ids, weights, num_experts), f"iteration {i}")
        counts["low_latency" if low_latency else "normal"] += 1
        counts["checks"] += check
        if rank == 0 and (i + 1) % PROGRESS_EVERY == 0:
            print(f"soak: {i + 1} of {args['iters']} iterations, {time.monotonic() - started:.1f} s", flush=True)
    after_soak = memory(device)
    for cycle in range(args["cycles"]):
        buffer = make_buffer(group, args["backend"], cycle % 2 == 1, args["timeout_s"], explicitly_destroy=True)
        low_latency, x, ids, weights = draw(cycle, rank, R, args["seed"] + 1, device)
        run = low_latency_round if buffer.low_latency_mode else normal_round
        run(buffer, x, ids, weights, num_experts)
        buffer.destroy()
    after_cycles = memory(device)
    return {"rank": rank, "seconds": round(time.monotonic() - started, 1), "counts": counts,
            "memory": {"before": before, "after_soak": after_soak, "after_cycles": after_cycles}}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--graph-every", type=int, default=4, help="every n-th low-latency round a graph replay")
    parser.add_argument("--backend", choices=("native", "reference"), default=None)
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="", help="write the per-rank results here (JSON)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = args.ranks or (gpus if gpus >= 2 else 2)
    settings = dict(iters=args.iters, cycles=args.cycles, check_every=args.check_every, graph_every=args.graph_every,
                    backend=args.backend or ("native" if gpus else "reference"), timeout_s=args.timeout_s,
                    seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30))
    print(f"soak: {ranks} ranks, {settings}", flush=True)
    results = parallel_launch(ranks, soak_rank, settings, timeout_s=max(600.0, args.iters * 0.5))
    for r in results:
        mem = r["memory"]
        growth = {k: mem["after_cycles"].get(k, 0) - mem["after_soak"].get(k, 0) for k in mem["after_cycles"]}
        print(f"rank {r['rank']}: {r['seconds']} s, {r['counts']}, memory before {mem['before']}, after the soak "
              f"{mem['after_soak']}, after {settings['cycles']} create/destroy cycles {mem['after_cycles']} "
              f"(growth over the cycles {growth})")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": settings, "ranks": results}, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
