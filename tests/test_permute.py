"""ep_plugin.permute: Megatron's permute order, the reverse sum, both gradients; the kernel on GPU."""
from __future__ import annotations

import pytest
import torch

from ep_plugin.permute import ExpertMajorOrder, gather_sum_rows, permute_rows, unpermute_rows

from megatron_env import megatron_core_installed, prepare
from native_helpers import poison_allocator


def random_routing(num_rows: int, num_experts: int, generator: torch.Generator, density: float = 0.3,
                   device: str = "cpu") -> torch.Tensor:
    routing = torch.rand(num_rows, num_experts, generator=generator) < density
    routing[: num_rows // 10] = False  # some rows go to no local expert
    return routing.to(device)


def loop_reference(rows: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """The sum in slot order, in fp32, as the kernel adds (an independent implementation)."""
    out = torch.zeros(slot_rows.size(0), rows.size(1), dtype=torch.float32, device=rows.device)
    for slot in range(slot_rows.size(1)):
        index = slot_rows[:, slot]
        picked = rows.float().index_select(0, index.clamp(min=0).long())
        out += torch.where((index >= 0).unsqueeze(1), picked, 0.0)
    return out.to(rows.dtype)


@pytest.mark.parametrize("num_rows,num_experts", [(37, 4), (200, 16), (64, 70), (0, 8)])
def test_order_is_megatrons_permute_order(num_rows, num_experts):
    if not megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    prepare()
    from megatron.core.transformer.moe import moe_utils
    generator = torch.Generator().manual_seed(num_rows * 100 + num_experts)
    routing = random_routing(num_rows, num_experts, generator)
    x = torch.randn(num_rows, 24, generator=generator)
    probs = torch.rand(num_rows, num_experts, generator=generator)
    num_out = int(routing.sum())
    want_rows, want_probs, want_indices, _, _ = moe_utils.permute(x, routing, probs=probs, num_out_tokens=num_out)

    order = ExpertMajorOrder.from_routing(routing, num_out)
    assert torch.equal(order.source_rows, want_indices)
    assert torch.equal(permute_rows(x, order), want_rows)
    assert torch.equal(order.permute_like_routing(probs), want_probs)
    # Every True entry has its output row; every False entry has -1.
    assert torch.equal(order.slot_rows >= 0, routing)
    hit = order.slot_rows[routing].long()
    assert torch.equal(order.source_rows[hit], routing.nonzero()[:, 0])


def test_unpermute_sums_every_copy_and_matches_megatron():
    if not megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    prepare()
    from megatron.core.transformer.moe import moe_utils
    generator = torch.Generator().manual_seed(3)
    routing = random_routing(150, 12, generator)
    num_out = int(routing.sum())
    expert_out = torch.randn(num_out, 40, generator=generator, dtype=torch.float64)
    order = ExpertMajorOrder.from_routing(routing, num_out)
    want = moe_utils.unpermute(expert_out, order.source_rows, restore_shape=torch.Size((150, 40)), routing_map=routing)
    got = unpermute_rows(expert_out, order)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[:15], torch.zeros(15, 40, dtype=torch.float64))  # rows without a local expert


def test_permute_and_unpermute_are_each_others_backward():
    generator = torch.Generator().manual_seed(5)
    routing = random_routing(90, 8, generator)
    num_out = int(routing.sum())
    order = ExpertMajorOrder.from_routing(routing, num_out)
    copies = routing.sum(dim=1, keepdim=True).double()

    x = torch.randn(90, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    permuted = permute_rows(x, order)
    restored = unpermute_rows(permuted, order)
    torch.testing.assert_close(restored, x * copies)  # each row summed over its copies
    grad_out = torch.randn(90, 16, generator=generator, dtype=torch.float64)
    (grad_x,) = torch.autograd.grad(restored, x, grad_out)
    torch.testing.assert_close(grad_x, grad_out * copies)

    assert torch.autograd.gradcheck(lambda t: permute_rows(t, order), (x[:, :3].detach().clone().requires_grad_(),))
    y = torch.randn(num_out, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpermute_rows(t, order), (y,))


def test_probs_gradient_flows_through_the_permutation():
    generator = torch.Generator().manual_seed(7)
    routing = random_routing(30, 5, generator)
    order = ExpertMajorOrder.from_routing(routing, int(routing.sum()))
    probs = torch.rand(30, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(order.permute_like_routing(probs).sum(), probs)
    assert torch.equal(grad, routing.double())


def test_routing_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"\[rows, experts\]"):
        ExpertMajorOrder.from_routing(torch.ones(3, dtype=torch.bool), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gather-and-sum kernel needs a CUDA GPU")
@pytest.mark.parametrize("num_rows,num_experts,hidden", [(1000, 32, 4096), (300, 70, 7168), (257, 3, 2880),
                                                         (64, 8, 8), (0, 8, 4096)])
def test_kernel_equals_the_slot_order_sum_bit_for_bit(num_rows, num_experts, hidden):
    import ep_plugin.permute as permute_module
    assert permute_module._C is not None, "ep_plugin._C is not built"
    generator = torch.Generator().manual_seed(num_rows + hidden)
    routing = random_routing(num_rows, num_experts, generator, device="cuda")
    num_out = int(routing.sum())
    order = ExpertMajorOrder.from_routing(routing, num_out)
    rows = torch.randn(num_out, hidden, generator=generator).to(torch.bfloat16).cuda()
    poison_allocator(64)  # the output reuses poisoned memory: every element must be written
    got = gather_sum_rows(rows, order.slot_rows)
    want = loop_reference(rows, order.slot_rows)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))

    x = torch.randn(num_rows, hidden, generator=generator).to(torch.bfloat16).cuda().requires_grad_()
    grad = torch.randn(num_out, hidden, generator=generator).to(torch.bfloat16).cuda()
    poison_allocator(64)
    (grad_x,) = torch.autograd.grad(permute_rows(x, order), x, grad)
    assert torch.equal(grad_x.view(torch.int16), loop_reference(grad, order.slot_rows).view(torch.int16))
