"""`ep_plugin.Buffer` as a drop-in for DeepEP V1's `deep_ep.Buffer` (docs/deepep-compat.md).

API: every public method of DeepEP's Buffer exists with the same name, kind (static or not),
positional order and defaults; the list comes from DeepEP's buffer.py (parsed with `ast`) where the
peer sources are present, else from the list checked in here (and the list must match the peer's).

Semantics, on EP_TEST_RANKS ranks, default 2 (reference backend over gloo, on the GPUs where there are
some; native backend on GPUs with the NVSHMEM extension, skipped without them), all under
torch.set_default_dtype(torch.bfloat16) (and, on GPU, set_default_device("cuda")): handle contents
against values computed from every rank's inputs, dispatch without top-k then cached dispatch and
combine with its handle, num_worst_tokens, previous_event / async_finish / allocate_on_comm_stream, the
low-latency handle, zero_copy, the mask buffer, bad input.
"""
from __future__ import annotations

import ast
import inspect
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from case_runner import assert_case_passed, run_each
from native_helpers import multi_gpu_ranks
import ep_plugin
from ep_plugin import Buffer
from ep_plugin.handles import DispatchHandle, source_token_index
from ep_plugin.launch import parallel_launch, rank_slots

# The native cases' low-latency Buffer needs the NVSHMEM extension (test_native_low_latency.py fails where
# NVSHMEM and nvcc are installed but the extension was not built, unless EP_PLUGIN_SKIP_NVSHMEM=1 asked so).
try:
    from ep_plugin import _C_nvshmem
except ImportError:
    _C_nvshmem = None

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
REPO = Path(__file__).resolve().parents[1]
RANKS = multi_gpu_ranks()
PEER_CANDIDATES = [REPO.parent / "shared" / "peers" / "deepep-v1", Path("/work/shared/peers/deepep-v1")]

# DeepEP V1's public Buffer API: (method, is staticmethod, ((parameter, default source or None), ...)).
DEEPEP_BUFFER_API: Tuple[Tuple[str, bool, Tuple[Tuple[str, Optional[str]], ...]], ...] = (
    ('__init__', False, (('self', None), ('group', None), ('num_nvl_bytes', '0'), ('num_rdma_bytes', '0'),
                         ('low_latency_mode', 'False'), ('num_qps_per_rank', '24'),
                         ('allow_nvlink_for_low_latency_mode', 'True'), ('allow_mnnvl', 'False'),
                         ('use_fabric', 'False'), ('explicitly_destroy', 'False'), ('enable_shrink', 'False'),
                         ('comm', 'None'))),
    ('destroy', False, (('self', None),)),
    ('is_sm90_compiled', True, ()),
    ('set_num_sms', True, (('new_num_sms', None),)),
    ('capture', True, ()),
    ('get_low_latency_rdma_size_hint', True, (('num_max_dispatch_tokens_per_rank', None), ('hidden', None),
                                              ('num_ranks', None), ('num_experts', None))),
    ('get_comm_stream', False, (('self', None),)),
    ('get_local_buffer_tensor', False, (('self', None), ('dtype', None), ('size', 'None'), ('offset', '0'),
                                        ('use_rdma_buffer', 'False'))),
    ('get_dispatch_config', True, (('num_ranks', None),)),
    ('get_combine_config', True, (('num_ranks', None),)),
    ('get_dispatch_layout', False, (('self', None), ('topk_idx', None), ('num_experts', None),
                                    ('previous_event', 'None'), ('async_finish', 'False'),
                                    ('allocate_on_comm_stream', 'False'))),
    ('dispatch', False, (('self', None), ('x', None), ('handle', 'None'), ('num_tokens_per_rank', 'None'),
                         ('num_tokens_per_rdma_rank', 'None'), ('is_token_in_rank', 'None'),
                         ('num_tokens_per_expert', 'None'), ('topk_idx', 'None'), ('topk_weights', 'None'),
                         ('expert_alignment', '1'), ('num_worst_tokens', '0'), ('config', 'None'),
                         ('previous_event', 'None'), ('async_finish', 'False'), ('allocate_on_comm_stream', 'False'))),
    ('combine', False, (('self', None), ('x', None), ('handle', None), ('topk_weights', 'None'), ('bias', 'None'),
                        ('config', 'None'), ('previous_event', 'None'), ('async_finish', 'False'),
                        ('allocate_on_comm_stream', 'False'))),
    ('internode_dispatch', False, (('self', None), ('x', None), ('handle', 'None'), ('num_tokens_per_rank', 'None'),
                                   ('num_tokens_per_rdma_rank', 'None'), ('is_token_in_rank', 'None'),
                                   ('num_tokens_per_expert', 'None'), ('topk_idx', 'None'), ('topk_weights', 'None'),
                                   ('expert_alignment', '1'), ('num_worst_tokens', '0'), ('config', 'None'),
                                   ('previous_event', 'None'), ('async_finish', 'False'),
                                   ('allocate_on_comm_stream', 'False'))),
    ('internode_combine', False, (('self', None), ('x', None), ('handle', None), ('topk_weights', 'None'),
                                  ('bias', 'None'), ('config', 'None'), ('previous_event', 'None'),
                                  ('async_finish', 'False'), ('allocate_on_comm_stream', 'False'))),
    ('clean_low_latency_buffer', False, (('self', None), ('num_max_dispatch_tokens_per_rank', None), ('hidden', None),
                                         ('num_experts', None))),
    ('low_latency_dispatch', False, (('self', None), ('x', None), ('topk_idx', None),
                                     ('num_max_dispatch_tokens_per_rank', None), ('num_experts', None),
                                     ('cumulative_local_expert_recv_stats', 'None'),
                                     ('dispatch_wait_recv_cost_stats', 'None'), ('use_fp8', 'True'),
                                     ('round_scale', 'False'), ('use_ue8m0', 'False'), ('async_finish', 'False'),
                                     ('return_recv_hook', 'False'))),
    ('low_latency_combine', False, (('self', None), ('x', None), ('topk_idx', None), ('topk_weights', None),
                                    ('handle', None), ('use_logfmt', 'False'), ('zero_copy', 'False'),
                                    ('async_finish', 'False'), ('return_recv_hook', 'False'), ('out', 'None'),
                                    ('combine_wait_recv_cost_stats', 'None'))),
    ('low_latency_update_mask_buffer', False, (('self', None), ('rank_to_mask', None), ('mask', 'False'))),
    ('low_latency_query_mask_buffer', False, (('self', None), ('mask_status', None))),
    ('low_latency_clean_mask_buffer', False, (('self', None),)),
    ('get_next_low_latency_combine_buffer', False, (('self', None), ('handle', None))),
)


# ---- the API ---------------------------------------------------------------------------------------
def peer_buffer_source() -> Optional[Path]:
    for root in PEER_CANDIDATES:
        path = root / "deep_ep" / "buffer.py"
        if path.is_file():
            return path
    return None


def parse_deepep_api(path: Path):
    """DeepEP's public Buffer methods from its source, in DEEPEP_BUFFER_API's form."""
    tree = ast.parse(path.read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Buffer"]
    api = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or (fn.name.startswith("_") and fn.name != "__init__"):
            continue
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
        args = fn.args.args
        defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
        api.append((fn.name, static, tuple((a.arg, d) for a, d in zip(args, defaults))))
    return tuple(api)


def deepep_api():
    path = peer_buffer_source()
    return parse_deepep_api(path) if path is not None else DEEPEP_BUFFER_API


def test_checked_in_api_matches_the_peer_source():
    path = peer_buffer_source()
    if path is None:
        pytest.skip("DeepEP V1's sources are not beside this checkout; the API tests use the checked-in list")
    assert parse_deepep_api(path) == DEEPEP_BUFFER_API


@pytest.mark.parametrize("name,static,params", deepep_api(), ids=[m[0] for m in deepep_api()])
def test_method_matches_deepep(name, static, params):
    assert hasattr(Buffer, name), f"Buffer.{name} is missing"
    assert isinstance(inspect.getattr_static(Buffer, name), staticmethod) == static, f"Buffer.{name}: staticmethod?"
    ours = [p for p in inspect.signature(inspect.getattr_static(Buffer, name).__func__ if static
                                         else getattr(Buffer, name)).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    got = [(p.name, None if p.default is p.empty else repr(p.default)) for p in ours]
    assert tuple(got[:len(params)]) == params, f"Buffer.{name}: parameters {got}, DeepEP's {list(params)}"
    for p in ours[len(params):]:  # ep_plugin's own additions come after DeepEP's, with defaults
        assert p.default is not p.empty, f"Buffer.{name}: ep_plugin's extra parameter {p.name} needs a default"


def test_default_device_mode_is_bypassed_only_when_alone():
    from torch.overrides import TorchFunctionMode

    from ep_plugin.buffer import _without_device_mode

    seen = []

    @_without_device_mode
    def probe():
        seen.append(torch._C._is_torch_function_mode_enabled())

    class Tracing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_default_device("cpu")
    try:
        probe()
        with Tracing():
            probe()
    finally:
        torch.set_default_device(None)
    probe()
    assert seen == [False, True, False]


def test_topk_idx_t_is_int64():
    assert ep_plugin.topk_idx_t is torch.int64
    assert isinstance(Buffer.is_sm90_compiled(), bool)


# ---- inputs every rank can rebuild for every rank ---------------------------------------------------
H, E, K, T_MAX = 256, 8, 3, 48


def rank_inputs(seed: int, rank: int, num_ranks: int, device) -> Dict[str, torch.Tensor]:
    """Rank `rank`'s tokens and routing for one case (distinct experts per token, some entries -1)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    T = int(torch.randint(8, T_MAX + 1, (1,), generator=gen, device="cpu"))
    ids = torch.rand(T, E, generator=gen, device="cpu").argsort(dim=1)[:, :K]
    ids = ids.masked_fill(torch.rand(T, K, generator=gen, device="cpu") < 0.2, -1)
    x = (torch.randn(T, H, generator=gen, device="cpu", dtype=torch.float32) * 4).to(torch.bfloat16)
    weights = torch.rand(T, K, generator=gen, device="cpu", dtype=torch.float32)
    num_local = E // num_ranks
    in_rank = torch.zeros(T, num_ranks, dtype=torch.bool, device="cpu")
    for r in range(num_ranks):
        in_rank[:, r] = ((ids >= r * num_local) & (ids < (r + 1) * num_local)).any(dim=1)
    per_expert = torch.stack([(ids == e).sum() for e in range(E)]).to(torch.int32)
    cpu = dict(x=x, topk_idx=ids.to(torch.int64), topk_weights=weights, is_token_in_rank=in_rank,
               num_tokens_per_rank=in_rank.sum(dim=0, dtype=torch.int32), num_tokens_per_expert=per_expert)
    return {name: value.to(device) for name, value in cpu.items()}


def all_inputs(seed: int, num_ranks: int) -> List[Dict[str, torch.Tensor]]:
    return [rank_inputs(seed, r, num_ranks, "cpu") for r in range(num_ranks)]


def assert_equal(name: str, got, want) -> None:
    if want is None:
        assert got is None, f"{name}: got {got!r}, want None"
        return
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{name}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if not torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got, want):
        raise AssertionError(f"{name}: differs at {(got != want).nonzero()[:5].tolist()}")


# ---- normal-mode expectations -----------------------------------------------------------------------
def expected_normal(inputs: List[Dict[str, torch.Tensor]], rank: int, num_worst_tokens: int = 0):
    R = len(inputs)
    counts = torch.stack([inp["is_token_in_rank"].sum(dim=0, dtype=torch.int32) for inp in inputs])  # [s][j]
    prefix = torch.cumsum(counts, dim=0, dtype=torch.int32)
    src_idx = torch.cat([inp["is_token_in_rank"][:, rank].nonzero().reshape(-1) for inp in inputs]).to(torch.int32)
    recv_x = torch.cat([inp["x"][inp["is_token_in_rank"][:, rank]] for inp in inputs])
    rows = num_worst_tokens or src_idx.numel()
    padded_src = torch.full((rows,), -1, dtype=torch.int32, device="cpu")
    padded_src[:src_idx.numel()] = src_idx
    padded_x = torch.zeros(rows, H, dtype=torch.bfloat16, device="cpu")
    padded_x[:recv_x.size(0)] = recv_x
    mine = inputs[rank]["is_token_in_rank"]
    first = prefix[rank - 1] if rank > 0 else torch.zeros(R, dtype=torch.int32, device="cpu")
    order = torch.cumsum(mine.to(torch.int32), dim=0, dtype=torch.int32) - 1
    send_head = torch.where(mine, first.unsqueeze(0) + order, torch.full_like(order, -1))
    num_local = E // R
    per_expert = [int(sum(inp["num_tokens_per_expert"][rank * num_local + e] for inp in inputs))
                  for e in range(num_local)]
    return dict(prefix=prefix, src_idx=padded_src, recv_x=padded_x, send_head=send_head, per_expert=per_expert,
                num_recv=src_idx.numel())


def expected_combine(inputs, rank: int) -> torch.Tensor:
    """Each rank r returns its received rows times 2**r (exact in bf16); the sums are exact in fp32."""
    mine = inputs[rank]
    scale = sum(mine["is_token_in_rank"][:, r].float() * 2.0 ** r for r in range(len(inputs)))
    return (mine["x"].float() * scale.unsqueeze(1)).to(torch.bfloat16)


# ---- cases (run on every rank) ----------------------------------------------------------------------
class Ctx:
    def __init__(self, rank: int, R: int, group, backend: str, seed: int) -> None:
        self.rank, self.R, self.group, self.backend, self.seed = rank, R, group, backend, seed
        # A Buffer works on the current GPU wherever there is one, the reference backend included.
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.case = 0
        hint = max(Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R),
                   Buffer.get_combine_config(R).get_nvl_buffer_size_hint(H * 2, R))
        # DeepEP's positional order: ..., allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink.
        self.nvl_bytes = hint
        self.normal = Buffer(group, hint, 0, False, 24, True, False, False, True, False,
                             config={"backend": backend})
        rdma = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, R, E)
        # Shrink mode (rank masking, case_mask_buffer): every low-latency case runs with a mask.
        self.ll = Buffer(group, 0, rdma, True, explicitly_destroy=True, enable_shrink=True,
                         config={"backend": backend})

    def inputs(self) -> List[Dict[str, torch.Tensor]]:
        self.case += 1
        return all_inputs(self.seed + self.case, self.R)

    def mine(self, inputs) -> Dict[str, torch.Tensor]:
        return {name: value.to(self.device) for name, value in inputs[self.rank].items()}


def case_buffer_surface(ctx: Ctx) -> None:
    assert ctx.normal.explicitly_destroy and not ctx.normal.enable_shrink  # from positions 9 and 10
    assert ctx.normal.backend_name == ctx.backend and ctx.ll.backend_name == ctx.backend


def check_normal_handle(ctx: Ctx, handle, want, mine) -> None:
    assert len(handle) == 6
    assert_equal("handle[0] rank_prefix_matrix", handle[0], want["prefix"])
    assert handle[1] is None and handle[2] is None
    assert_equal("handle[3] recv_src_idx", handle[3], want["src_idx"])
    assert_equal("handle[4] is_token_in_rank", handle[4], mine["is_token_in_rank"].cpu())
    assert_equal("handle[5] send_head", handle[5], want["send_head"])
    assert tuple(handle)[0] is handle[0]  # computed once
    assert handle.num_recv_rows == want["src_idx"].numel()  # ep_plugin's fields stay attributes
    assert handle[-6] is handle[0] and handle[3:5] == (handle[3], handle[4])
    with pytest.raises(IndexError):
        handle[6]


def case_dispatch_handle(ctx: Ctx) -> None:
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    want = expected_normal(inputs, ctx.rank)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = ctx.normal.dispatch(
        mine["x"], num_tokens_per_rank=mine["num_tokens_per_rank"], is_token_in_rank=mine["is_token_in_rank"],
        num_tokens_per_expert=mine["num_tokens_per_expert"], topk_idx=mine["topk_idx"],
        topk_weights=mine["topk_weights"])
    assert_equal("recv_x", recv_x, want["recv_x"])
    assert per_expert == want["per_expert"]
    assert recv_idx is not None and recv_w is not None
    check_normal_handle(ctx, handle, want, mine)


def case_dispatch_without_topk(ctx: Ctx) -> None:
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    want = expected_normal(inputs, ctx.rank)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = ctx.normal.dispatch(
        mine["x"], num_tokens_per_rank=mine["num_tokens_per_rank"], is_token_in_rank=mine["is_token_in_rank"],
        num_tokens_per_expert=mine["num_tokens_per_expert"])
    assert recv_idx is None and recv_w is None
    assert_equal("recv_x", recv_x, want["recv_x"])
    assert per_expert == want["per_expert"]
    check_normal_handle(ctx, handle, want, mine)
    # Cached dispatch with that handle moves other rows the same way.
    y = (mine["x"].float() * -0.5).to(torch.bfloat16)
    cached, none_idx, none_w, none_list, none_handle, _ = ctx.normal.dispatch(y, handle=handle)
    assert none_idx is None and none_w is None and none_list is None and none_handle is None
    assert_equal("cached recv_x", cached, (want["recv_x"].float() * -0.5).to(torch.bfloat16))
    # Combine with that handle: rank r returns its rows times 2**r.
    combined, combined_w, _ = ctx.normal.combine((recv_x.float() * 2.0 ** ctx.rank).to(torch.bfloat16), handle)
    assert combined_w is None
    assert_equal("combined", combined, expected_combine(inputs, ctx.rank))


def _scale_layouts(x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """[T, H / 128] scales of `x` (CPU) as DeepEP programs pass them: float32 row-major, float32 column-major
    (DeepGEMM's layout, `.T.contiguous().T`), and int32 (packed UE8M0 words, column-major)."""
    scales = x[:, ::128].float() + 0.5
    packed = (scales * 1000).to(torch.int32)
    return {"float32": scales, "float32 column-major": scales.T.contiguous().T,
            "int32 column-major": packed.T.contiguous().T}


def case_fp8_scale_layouts(ctx: Ctx) -> None:
    """FP8 rows with each scale layout of `_scale_layouts`: the scales arrive row-major, in their dtype, with
    their rows (dispatch and cached dispatch), bit for bit."""
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    received = [inp["is_token_in_rank"][:, ctx.rank] for inp in inputs]
    want_rows = torch.cat([inp["x"].float().to(torch.float8_e4m3fn)[sent] for inp, sent in zip(inputs, received)])
    layout = dict(num_tokens_per_rank=mine["num_tokens_per_rank"], is_token_in_rank=mine["is_token_in_rank"],
                  num_tokens_per_expert=mine["num_tokens_per_expert"])
    rows = mine["x"].float().to(torch.float8_e4m3fn)
    layouts = [_scale_layouts(inp["x"]) for inp in inputs]  # every source's scales, each layout
    for name, scales in layouts[ctx.rank].items():
        want_scales = torch.cat([layout[name][sent].contiguous() for layout, sent in zip(layouts, received)])
        (recv_rows, recv_scales), _, _, _, handle, _ = ctx.normal.dispatch(
            (rows, scales.to(ctx.device)), topk_idx=mine["topk_idx"], **layout)
        assert recv_rows.dtype == torch.float8_e4m3fn
        assert_equal(f"{name}: recv_x rows", recv_rows.view(torch.uint8), want_rows.view(torch.uint8))
        assert recv_scales.is_contiguous(), f"{name}: recv scales strides {recv_scales.stride()}"
        assert_equal(f"{name}: recv scales", recv_scales, want_scales)
        (cached_rows, cached_scales), *_ = ctx.normal.dispatch((rows, scales.to(ctx.device)), handle=handle)
        assert_equal(f"{name}: cached rows", cached_rows.view(torch.uint8), want_rows.view(torch.uint8))
        assert_equal(f"{name}: cached scales", cached_scales, want_scales)


def case_handle_from_gathered_counts(ctx: Ctx) -> None:
    """A backend handle without the count matrix (as the native one): positions 0, 5 and the internode
    tuple's 6 come from an all_gather of every rank's send counts over the group."""
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    want = expected_normal(inputs, ctx.rank)
    _, _, _, _, handle, _ = ctx.normal.dispatch(
        mine["x"], num_tokens_per_rank=mine["num_tokens_per_rank"], is_token_in_rank=mine["is_token_in_rank"],
        num_tokens_per_expert=mine["num_tokens_per_expert"], topk_idx=mine["topk_idx"])
    bare = SimpleNamespace(owner=handle.owner, recv_src_idx=handle[3], num_recv_rows=handle.num_recv_rows)
    intranode = DispatchHandle(bare, mine["is_token_in_rank"], ctx.rank, True, ctx.normal._gather_counts)
    check_normal_handle(ctx, intranode, want, mine)
    internode = DispatchHandle(bare, mine["is_token_in_rank"], ctx.rank, False, ctx.normal._gather_counts)
    assert len(internode) == 10 and internode[0] is mine["is_token_in_rank"]
    counts = torch.diff(want["prefix"][:, ctx.rank], prepend=torch.zeros(1, dtype=torch.int32, device="cpu"))
    assert_equal("internode handle[6]", internode[6], torch.cumsum(counts, dim=0, dtype=torch.int32))
    assert all(internode[i] is None for i in (1, 2, 3, 4, 5, 7, 8, 9))


def test_source_token_index_unpacks_native_slot_info():
    src_rank = torch.tensor([0, 1, 3, 1023], dtype=torch.int32)
    token = torch.tensor([0, 5, 4095, 65535], dtype=torch.int32)
    k = torch.tensor([0, 7, 31, 3], dtype=torch.int32)
    packed = (src_rank << 21) | (token * 32 + k)
    assert torch.equal(source_token_index(packed), token)


def case_num_worst_tokens(ctx: Ctx) -> None:
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    worst = max(expected_normal(inputs, r)["num_recv"] for r in range(ctx.R)) + 5
    want = expected_normal(inputs, ctx.rank, worst)
    recv_x, recv_idx, _, per_expert, handle, _ = ctx.normal.dispatch(
        mine["x"], num_tokens_per_rank=mine["num_tokens_per_rank"], is_token_in_rank=mine["is_token_in_rank"],
        num_tokens_per_expert=mine["num_tokens_per_expert"], topk_idx=mine["topk_idx"], num_worst_tokens=worst)
    assert per_expert == [] and recv_x.size(0) == worst and recv_idx.size(0) == worst
    assert_equal("recv_x (real rows)", recv_x[:want["num_recv"]], want["recv_x"][:want["num_recv"]])
    assert bool((recv_idx[want["num_recv"]:] == -1).all())
    check_normal_handle(ctx, handle, want, mine)
    combined, _, _ = ctx.normal.combine((recv_x.float() * 2.0 ** ctx.rank).to(torch.bfloat16), handle)
    assert_equal("combined", combined, expected_combine(inputs, ctx.rank))


def case_events(ctx: Ctx) -> None:
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    want = expected_normal(inputs, ctx.rank)
    before = Buffer.capture()
    *layout, event = ctx.normal.get_dispatch_layout(mine["topk_idx"], E, previous_event=before, async_finish=True,
                                                    allocate_on_comm_stream=True)
    event.current_stream_wait()
    assert_equal("is_token_in_rank", layout[3], mine["is_token_in_rank"].cpu())
    recv_x, _, _, _, handle, event = ctx.normal.dispatch(
        mine["x"], num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=mine["topk_idx"], previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    with event:  # the current stream waits when the block exits
        pass
    assert_equal("recv_x", recv_x, want["recv_x"])
    combined, _, event = ctx.normal.combine((recv_x.float() * 2.0 ** ctx.rank).to(torch.bfloat16), handle,
                                            previous_event=Buffer.capture(), async_finish=True)
    event.current_stream_wait()
    assert_equal("combined", combined, expected_combine(inputs, ctx.rank))


def ll_expected(inputs, rank: int):
    """Per local expert: (source rank, source token) of each filled slot, in slot order."""
    R = len(inputs)
    num_local = E // R
    slots = []
    for e in range(num_local):
        expert = rank * num_local + e
        slots.append([(s, int(t)) for s, inp in enumerate(inputs)
                      for t in (inp["topk_idx"] == expert).any(dim=1).nonzero().reshape(-1)])
    return slots


def case_low_latency_handle(ctx: Ctx) -> None:
    inputs = ctx.inputs()
    mine = ctx.mine(inputs)
    recv_x, recv_count, handle, _, _ = ctx.ll.low_latency_dispatch(mine["x"], mine["topk_idx"], T_MAX, E,
                                                                   use_fp8=False)
    assert len(handle) == 5 and tuple(handle)[2:] == (T_MAX, H, E)
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    assert src_info.dtype == torch.int32 and src_info.shape == (E // ctx.R, ctx.R * T_MAX)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (E // ctx.R, ctx.R)
    for e, slots in enumerate(ll_expected(inputs, ctx.rank)):
        assert int(recv_count[e]) == len(slots)
        assert_equal(f"src_info[{e}]", src_info[e, :len(slots)], torch.tensor([t for _, t in slots], dtype=torch.int32, device="cpu"))
        assert_equal(f"recv_x[{e}]", recv_x[e, :len(slots)], torch.stack([inputs[s]["x"][t] for s, t in slots])
                     if slots else torch.zeros(0, H, dtype=torch.bfloat16, device="cpu"))
        for s in range(ctx.R):
            count = sum(1 for src, _ in slots if src == s)
            first = sum(1 for src, _ in slots if src < s)
            assert int(layout_range[e, s]) == (first << 32) | count, f"layout_range[{e}, {s}]"
    ctx.ll.low_latency_combine(recv_x, mine["topk_idx"], mine["topk_weights"], handle)  # the round completes


def ll_round(ctx: Ctx, mine, zero_copy: bool) -> torch.Tensor:
    recv_x, _, handle, _, _ = ctx.ll.low_latency_dispatch(mine["x"], mine["topk_idx"], T_MAX, E, use_fp8=False)
    expert_out = (recv_x.float() * 0.5).to(torch.bfloat16)
    if not zero_copy:
        return ctx.ll.low_latency_combine(expert_out, mine["topk_idx"], mine["topk_weights"], handle)[0]
    ctx.ll.get_next_low_latency_combine_buffer(handle).copy_(expert_out)
    ignored = torch.full(expert_out.shape, float("nan"), dtype=torch.bfloat16, device=ctx.device)
    return ctx.ll.low_latency_combine(ignored, mine["topk_idx"], mine["topk_weights"], handle, zero_copy=True)[0]


def case_zero_copy(ctx: Ctx) -> None:
    mine = ctx.mine(ctx.inputs())
    copied = ll_round(ctx, mine, zero_copy=False)
    zero = ll_round(ctx, mine, zero_copy=True)
    assert_equal("zero_copy combine", zero, copied.cpu())
    routed = (mine["topk_idx"] >= 0).float()
    want = mine["x"].float() * 0.5 * (mine["topk_weights"] * routed).sum(dim=1, keepdim=True)
    torch.testing.assert_close(zero.float(), want, rtol=2e-2, atol=2e-2)


def case_mask_buffer(ctx: Ctx) -> None:
    status = torch.full((ctx.R,), 7, dtype=torch.int32, device=ctx.device)
    with pytest.raises(RuntimeError, match="enable_shrink=True"):
        ctx.normal.low_latency_clean_mask_buffer()
    with pytest.raises(ValueError, match="rank_to_mask"):
        ctx.ll.low_latency_update_mask_buffer(ctx.R)
    for other in range(ctx.R):
        if other != ctx.rank:
            ctx.ll.low_latency_update_mask_buffer(other, True)
    ctx.ll.low_latency_query_mask_buffer(status)
    assert status.tolist() == [int(r != ctx.rank) for r in range(ctx.R)]
    # Each rank masks all the others: tokens reach only this rank's experts; the others' count as zero.
    mine = ctx.mine(ctx.inputs())
    num_local = E // ctx.R
    recv_x, recv_count, handle, _, _ = ctx.ll.low_latency_dispatch(mine["x"], mine["topk_idx"], T_MAX, E,
                                                                   use_fp8=False)
    local = (mine["topk_idx"] >= ctx.rank * num_local) & (mine["topk_idx"] < (ctx.rank + 1) * num_local)
    assert recv_count.tolist() == [int((mine["topk_idx"] == ctx.rank * num_local + e).sum()) for e in range(num_local)]
    combined, _, _ = ctx.ll.low_latency_combine(recv_x, mine["topk_idx"], mine["topk_weights"], handle)
    want = mine["x"].float() * (mine["topk_weights"] * local.float()).sum(dim=1, keepdim=True)
    torch.testing.assert_close(combined.float(), want, rtol=2e-2, atol=2e-2)
    ctx.ll.low_latency_clean_mask_buffer()
    ctx.ll.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * ctx.R


def case_local_buffer_tensor(ctx: Ctx) -> None:
    if ctx.backend != "reference":
        with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
            ctx.normal.get_local_buffer_tensor(torch.int32)
        return
    whole = ctx.normal.get_local_buffer_tensor(torch.int32)
    assert whole.dtype == torch.int32 and whole.numel() == ctx.normal.num_nvl_bytes // 4
    part = ctx.normal.get_local_buffer_tensor(torch.bfloat16, torch.Size((4, 8)), offset=64)
    part.fill_(3)
    assert part.shape == (4, 8) and bool((whole[16:32].view(torch.bfloat16) == 3).all())
    with pytest.raises(ValueError, match="offset"):
        ctx.normal.get_local_buffer_tensor(torch.int32, offset=2)


def case_bad_input(ctx: Ctx) -> None:
    mine = ctx.mine(ctx.inputs())
    with pytest.raises(ValueError, match="topk_weights needs topk_idx"):
        ctx.normal.dispatch(mine["x"], num_tokens_per_rank=mine["num_tokens_per_rank"],
                            is_token_in_rank=mine["is_token_in_rank"],
                            num_tokens_per_expert=mine["num_tokens_per_expert"], topk_weights=mine["topk_weights"])
    with pytest.raises(ValueError, match="num_tokens_per_rank, is_token_in_rank"):
        ctx.normal.dispatch(mine["x"], topk_idx=mine["topk_idx"])
    with pytest.raises(ValueError, match="does not come from this Buffer"):
        ctx.normal.combine(mine["x"], (torch.zeros(2, 2, dtype=torch.int32, device=ctx.device),) * 6)
    with pytest.raises(ValueError, match="config"):
        ctx.normal.internode_combine(mine["x"], None)
    with pytest.raises(NotImplementedError, match="use_fabric"):
        Buffer(ctx.group, 0, 0, False, 24, True, False, True)
    with pytest.raises(NotImplementedError, match="comm="):
        Buffer(None, comm=object())


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def compat_rank(rank: int, R: int, group, backend: str, seed: int) -> dict:
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")  # the default-device mode is active
    ctx = Ctx(rank, R, group, backend, seed)
    results = run_each({name: (lambda fn=fn: fn(ctx)) for name, fn in CASES.items()}, CASES)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ctx.normal.destroy()
    ctx.ll.destroy()
    return results


_RESULTS: Dict[str, list] = {}


def results_for(backend: str) -> list:
    if backend not in _RESULTS:
        # NOTE: native ranks take NCCL on GPUs of their own, gloo where they share one under MPS.
        _RESULTS[backend] = parallel_launch(RANKS, compat_rank, backend, BASE_SEED,
                                            backend=None if backend == "native" else "gloo")
    return _RESULTS[backend]


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=[
    pytest.mark.skipif(rank_slots() < RANKS,
                       reason=f"the native backend needs {RANKS} ranks on GPUs (own, or shares of one under MPS)"),
    pytest.mark.skipif(_C_nvshmem is None,
                       reason="its low-latency Buffer needs ep_plugin._C_nvshmem, not built here")])])
@pytest.mark.parametrize("case", sorted(CASES))
def test_deepep_semantics(backend, case):
    assert_case_passed(results_for(backend), case, f"{backend}, case {case}, EP_TEST_SEED={BASE_SEED}")
