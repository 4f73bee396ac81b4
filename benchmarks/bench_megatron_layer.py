"""Megatron-Core MoE layer with the `ep_plugin`, `flex` (DeepEP), `alltoall` and `allgather` token dispatchers.

`flex` is Megatron's `--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep` on DeepEP V1
(`deep_ep` must be importable; it needs no TransformerEngine without --permute-fusion), with DeepEP
given the SM count of ep_plugin's config (`num_sms`), so both dispatchers run on as many SMs.
By default the run measures ep_plugin, flex (where `deep_ep` imports) and alltoall.

For each dispatcher, on the same weights, inputs and routing:

- dispatcher round: Megatron's six dispatcher methods forward (dispatch_preprocess ... combine_postprocess)
  and their backward, with the experts replaced by a stand-in, the scaling of each row by its prob (as
  Megatron's dispatcher tests do);
- stand-in: that scaling alone, forward and backward, on tensors of the shapes it gets in the round
  ([M, H] bf16 rows, [M] probs). It costs as much as the whole dispatcher (M x H fp32 products), so
- dispatcher time = round - stand-in (per rank, then the slowest rank): the dispatcher's own work
  (permutations, communication, host syncs). The round and the stand-in are reported too;
- layer step: the whole MoELayer forward + backward (router, dispatch, experts, combine). The experts
  (--expert-impl): SequentialMLP (one chain of small kernels per expert), `grouped` (Megatron's
  TEGroupedMLP on PyTorch's grouped GEMM, torch_grouped_experts.py: no TransformerEngine needed) or
  `te` (TransformerEngine's grouped GEMM).

The dispatchers' layers live side by side and take turns in every timed iteration (the layer step
is bound by the host's launch rate, which drifts between minutes; turns give every dispatcher the
same conditions). Each timed call: L2 flushed, ranks aligned by a barrier, Python's GC off, CUDA
events around the work on the current stream. Per rank: median, p10, p90, min, max over the timed iterations; a step's time is the
slowest rank's median. Also reported: the "algorithmic" bandwidth of the dispatcher,
GB/s = 4 * T * top-k * H * 2 bytes / time (every (token, expert) row once in each of dispatch,
combine and their two backward passes), the same formula for every dispatcher.

    python3 benchmarks/bench_megatron_layer.py --expert-impl grouped --out benchmarks/results/h100x2-ep2-megatron-layer.json

Defaults: hidden 4096, 64 experts, top-6, FFN hidden 1408, 8192 tokens per rank, bf16, EP 2.
Targets: ep_plugin's dispatcher time <= 0.5 x flex+DeepEP's and layer step >= 1.3x faster; against
alltoall: <= 0.5 x and >= 1.15x.
Importable without a GPU (the work runs in spawned ranks).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

DISPATCHERS = ("ep_plugin", "flex", "alltoall", "allgather")
# Target per baseline: (largest dispatcher-time ratio ours / theirs, smallest layer-step speed-up).
TARGETS = {"flex": (0.5, 1.3), "alltoall": (0.5, 1.15)}
L2_FLUSH_BYTES = 256 << 20


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64, dest="num_experts")
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=1408, help="expert FFN hidden size")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--ranks", type=int, default=2, help="GPUs (= EP size)")
    parser.add_argument("--dispatchers", default=None,
                        help=f"comma-separated, from {DISPATCHERS} (default: ep_plugin, flex where deep_ep imports, "
                             "alltoall)")
    parser.add_argument("--expert-impl", choices=("sequential", "grouped", "te"), default="sequential",
                        help="SequentialMLP, TEGroupedMLP on torch's grouped_mm (no TE), or TE's grouped GEMM (needs TE)")
    parser.add_argument("--permute-fusion", action="store_true", help="moe_permute_fusion (needs TE)")
    parser.add_argument("--ep-plugin-config", default=None, help="ep_plugin YAML for the ep_plugin dispatcher")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="write the results (JSON) here")
    parser.add_argument("--profile-dir", default=None,
                        help="also profile 2 dispatcher rounds and 2 layer steps per dispatcher (torch.profiler): "
                             "a kernel table per rank and rank 0's Chrome traces go here")
    args = parser.parse_args(argv)
    if args.dispatchers is None:
        args.dispatchers = ["ep_plugin", *(["flex"] if deep_ep_importable() else []), "alltoall"]
    else:
        args.dispatchers = [d.strip() for d in args.dispatchers.split(",") if d.strip()]
    unknown = sorted(set(args.dispatchers) - set(DISPATCHERS))
    if unknown:
        parser.error(f"unknown dispatchers {unknown}; choose from {DISPATCHERS}")
    if "flex" in args.dispatchers and not deep_ep_importable():
        parser.error("--dispatchers flex needs DeepEP V1 (`import deep_ep`); see docs/megatron.md")
    if args.num_experts % args.ranks:
        parser.error(f"--experts {args.num_experts} is not divisible by --ranks {args.ranks}")
    return args


# ---- inside the ranks -----------------------------------------------------------------------------------
def deep_ep_importable() -> bool:
    """Whether DeepEP V1's `deep_ep` package is on the path (Megatron's flex dispatcher uses it)."""
    import importlib.util
    return importlib.util.find_spec("deep_ep") is not None


def _setup(args: argparse.Namespace) -> None:
    import megatron_env
    megatron_env.prepare()
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    import ep_plugin.integrations.megatron as ep_megatron

    if args.ep_plugin_config:
        ep_megatron.register(config=args.ep_plugin_config)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=args.ranks)
    model_parallel_cuda_manual_seed(args.seed)


def layer_config_kwargs(args: argparse.Namespace, dispatcher: str) -> Dict:
    """TransformerConfig arguments of the benchmarked layer; `flex` runs DeepEP on ep_plugin's SM count."""
    kwargs = dict(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=32, num_moe_experts=args.num_experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=args.ranks, bf16=True,
        params_dtype=torch.bfloat16, moe_router_dtype="fp32", add_bias_linear=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=args.expert_impl == "te", moe_permute_fusion=args.permute_fusion)
    if dispatcher == "flex":
        from ep_plugin.integrations.megatron import resolve_config
        kwargs.update(moe_flex_dispatcher_backend="deepep", moe_flex_dispatcher_num_sms=resolve_config().num_sms)
    return kwargs


def _build_layer(args: argparse.Namespace, dispatcher: str):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**layer_config_kwargs(args, dispatcher))
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    spec = get_moe_module_spec(use_te=args.expert_impl == "te", num_experts=args.num_experts,
                               moe_grouped_gemm=args.expert_impl == "te")
    submodules = spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules
    if args.expert_impl == "grouped":
        from torch_grouped_experts import grouped_experts_builder
        submodules = dataclasses.replace(submodules, experts=grouped_experts_builder())
    return MoELayer(config, submodules).cuda()


def _scale_by_probs(tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' stand-in: each row times its prob (in the probs' precision), back in the rows' dtype."""
    return (tokens * probs.unsqueeze(-1)).to(tokens.dtype)


def _dispatcher_round(layer, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                      grad: torch.Tensor, seen: Optional[Dict] = None) -> None:
    """The six dispatcher methods with the experts replaced by the stand-in, then the backward.
    `seen` (optional) receives the stand-in's input shapes and dtypes."""
    dispatcher = layer.token_dispatcher
    tokens, weights = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, weights = dispatcher.token_dispatch(tokens, weights)
    tokens, _, permuted_probs = dispatcher.dispatch_postprocess(tokens, weights)
    if seen is not None:
        seen.update(rows=tuple(tokens.shape), rows_dtype=tokens.dtype, probs_dtype=permuted_probs.dtype)
    tokens = _scale_by_probs(tokens, permuted_probs)
    tokens = dispatcher.combine_preprocess(tokens)
    tokens = dispatcher.token_combine(tokens)
    output = dispatcher.combine_postprocess(tokens)
    torch.autograd.backward(output, grad)


def _stand_in_step(seen: Dict, gen: torch.Generator) -> Callable[[], None]:
    """The stand-in alone, forward and backward, on fresh tensors shaped as in the round."""
    rows = torch.randn(seen["rows"], generator=gen, device="cuda").to(seen["rows_dtype"]).requires_grad_()
    probs = torch.rand(seen["rows"][0], generator=gen, device="cuda").to(seen["probs_dtype"]).requires_grad_()
    grad = torch.randn(seen["rows"], generator=gen, device="cuda").to(seen["rows_dtype"])
    return lambda: torch.autograd.backward(_scale_by_probs(rows, probs), grad)


def _layer_step(layer, hidden: torch.Tensor, grad: torch.Tensor) -> None:
    output, _ = layer(hidden)
    torch.autograd.backward(output, grad)


def _time_interleaved(steps: Dict[str, Callable[[], None]], warmup: int, iters: int,
                      flush: torch.Tensor) -> Dict[str, List[float]]:
    """Milliseconds of each timed call of each step. The steps take turns (A B C, B C A, ...) so that
    drifting host conditions fall on all of them alike: the layer step is bound by the host's launch
    rate, which changes by 20-30% between minutes. Before each call the L2 is flushed and the ranks
    are aligned by a barrier. Python's garbage collector is off while timing (as with Megatron's
    --manual-gc): its pauses would land on random steps."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    torch.cuda.synchronize()
    times: Dict[str, List[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for i in range(iters):
            for name in names[i % len(names):] + names[:i % len(names)]:
                flush.zero_()
                torch.distributed.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    finally:
        gc.enable()
    return times


def _step_memory_gib(step: Callable[[], None]) -> float:
    """Memory one call of `step` allocates at its peak, beyond what is allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _profile_steps(step, name: str, rank: int, out_dir: str, steps: int = 2, with_stack: bool = False) -> None:
    """Op tables by GPU time and by host time of `steps` calls of `step`; rank 0 also writes its Chrome trace
    (with `with_stack`, Python functions too: benchmarks/probes/trace_gaps.py then names the Python code behind a
    GPU-idle gap, at the price of slower host code while profiling)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    averages = prof.key_averages()
    with open(os.path.join(out_dir, f"megatron_{name}_rank{rank}.txt"), "w") as handle:
        handle.write(averages.table(sort_by="self_device_time_total", row_limit=30))
        handle.write("\n\nBy host time:\n")
        handle.write(averages.table(sort_by="self_cpu_time_total", row_limit=30))
    if rank == 0:
        prof.export_chrome_trace(os.path.join(out_dir, f"megatron_{name}_rank0.json"))


def _summary(times: List[float]) -> Dict[str, float]:
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]  # noqa: E731
    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9),
            "min": ordered[0], "max": ordered[-1]}


def bench_worker(rank: int, world: int, group, args: argparse.Namespace) -> Dict:
    _setup(args)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(args.seed * 31 + rank)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    grad = torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    state = None
    rounds, stand_ins, layer_steps, info = {}, {}, {}, {}
    for name in args.dispatchers:  # every layer lives until the end: their steps are timed in turns
        layer = _build_layer(args, name)
        if state is None:
            state = {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
        else:
            layer.load_state_dict(state, strict=False)
        with torch.no_grad():
            probs, routing_map = layer.router(hidden)
        probs = probs.detach().requires_grad_()
        x = hidden.clone().requires_grad_()
        seen: Dict = {}
        _dispatcher_round(layer, x, probs, routing_map, grad, seen)
        rounds[name] = functools.partial(_dispatcher_round, layer, x, probs, routing_map, grad)
        stand_ins[name] = _stand_in_step(seen, gen)
        layer_steps[name] = functools.partial(_layer_step, layer, x, grad)
        info[name] = {"stand_in_rows": seen["rows"][0]}
        if name == "flex":
            info[name]["num_sms"] = layer.config.moe_flex_dispatcher_num_sms
        buffer = getattr(layer.token_dispatcher, "buffer", None)
        if buffer is not None:
            info[name].update(backend=buffer.backend_name, num_sms=buffer.num_sms,
                              # "copy_engine", "pull" or "sm" for the native intranode combine (its last call)
                              combine_path=getattr(buffer._backend, "last_combine_path", ""))
    round_ms = _time_interleaved(rounds, args.warmup, args.iters, flush)
    stand_in_ms = _time_interleaved(stand_ins, args.warmup, args.iters, flush)
    layer_ms = _time_interleaved(layer_steps, args.warmup, args.iters, flush)
    results = {}
    for name in args.dispatchers:
        if args.profile_dir:
            _profile_steps(rounds[name], f"{name}_dispatcher", rank, args.profile_dir, with_stack=True)
            _profile_steps(layer_steps[name], name, rank, args.profile_dir)
        results[name] = {"round_ms": _summary(round_ms[name]), "stand_in_ms": _summary(stand_in_ms[name]),
                         "dispatcher_ms": statistics.median(round_ms[name]) - statistics.median(stand_in_ms[name]),
                         "layer_step_ms": _summary(layer_ms[name]),
                         "step_memory_gib": _step_memory_gib(layer_steps[name]), **info[name]}
    return results


# ---- the parent ----------------------------------------------------------------------------------------
def _combine_ranks(per_rank: List[Dict], args: argparse.Namespace) -> Dict:
    """A dispatcher's time is its slowest rank's median; speed-ups are relative to ep_plugin."""
    table = {}
    for name in args.dispatchers:
        entry = {"per_rank": [r[name] for r in per_rank]}
        for metric in ("round_ms", "stand_in_ms", "layer_step_ms"):
            entry[metric] = max(r[name][metric]["median"] for r in per_rank)
        entry["dispatcher_ms"] = max(r[name]["dispatcher_ms"] for r in per_rank)
        rows = args.tokens * args.topk
        entry["dispatcher_algorithmic_gbps"] = 4 * rows * args.hidden * 2 / (entry["dispatcher_ms"] * 1e-3) / 1e9
        table[name] = entry
    targets = {}
    for baseline, (max_ratio, min_speedup) in TARGETS.items():
        if "ep_plugin" not in table or baseline not in table:
            continue
        ours, theirs = table["ep_plugin"], table[baseline]
        ratio, speedup = ours["dispatcher_ms"] / theirs["dispatcher_ms"], theirs["layer_step_ms"] / ours["layer_step_ms"]
        suffix = "" if baseline == "alltoall" else f"_vs_{baseline}"
        targets.update({
            f"dispatcher_time_ratio_vs_{baseline}": ratio,
            f"dispatcher_target_met{suffix} (<= {max_ratio})": ratio <= max_ratio,
            f"layer_speedup_vs_{baseline}": speedup,
            f"layer_target_met{suffix} (>= {min_speedup})": speedup >= min_speedup,
        })
    return {"results": table, "targets": targets}


def _environment() -> Dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        from ep_plugin.integrations.megatron import megatron_version
        info["megatron_core"] = megatron_version()  # the imported code's
    except Exception:  # noqa: BLE001 - informational only
        pass
    if deep_ep_importable():
        import deep_ep
        info["deep_ep"] = os.path.dirname(deep_ep.__file__)
    return info


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.ranks:
        print(f"bench_megatron_layer: needs {args.ranks} CUDA GPUs", file=sys.stderr)
        return 2
    from ep_plugin.launch import parallel_launch

    started = time.time()
    # Reported (ranks ended) within 260 s: inside gpu_session.sh's 300 s for this stage (expected: 1-2 min; unmeasured).
    per_rank = parallel_launch(args.ranks, bench_worker, args, timeout_s=200)
    report = {
        "benchmark": "megatron_moe_layer",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": _environment(),
        "formula": "dispatcher_ms = round_ms - stand_in_ms (per rank; the slowest rank's); "
                   "dispatcher_algorithmic_gbps = 4 * tokens * topk * hidden * 2 B / dispatcher time",
        "wall_s": round(time.time() - started, 1),
        **_combine_ranks(per_rank, args),
    }
    for name, entry in report["results"].items():
        print(f"{name:>10}: dispatcher {entry['dispatcher_ms']:8.3f} ms (round {entry['round_ms']:.3f} - stand-in "
              f"{entry['stand_in_ms']:.3f})   layer step {entry['layer_step_ms']:8.3f} ms")
    for key, value in report["targets"].items():
        print(f"{key}: {value}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as file:
            json.dump(report, file, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
