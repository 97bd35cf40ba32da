"""Kept dequantized weights (exact mode on the CPU): results stay bit-identical to the kernels' GEMMs on the stored
weights, also after the stored weights change in place (reload, direct write, EPLB-style slot rearrangement)."""

from __future__ import annotations

import torch

from deepinfer_kernels import (
    ExpertRows,
    fp8_block_gemm,
    mxfp4_gemm,
    mxfp4_grouped_gemm,
    quantize_fp8_block,
    quantize_mxfp4,
)
from deepinfer_kernels.testing import assert_bitwise_equal
from deepinfer_model.layers.dequantized import DequantizedCache
from deepinfer_model.layers.linear import Fp8BlockLinear, Mxfp4ExpertStack
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.eplb.rebalance import rearrange_expert_weights
from deepinfer_parallel.groups import RankGroup

EXACT = ComputeMode.EXACT
EXPERTS, IN, OUT = 4, 64, 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_weight(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_block(torch.randn(OUT, IN, generator=_gen(seed)) / 8)


def _load_fp8(layer: Fp8BlockLinear, seed: int) -> None:
    q, s = _fp8_weight(seed)
    layer.weight.weight_loader(layer.weight, q)
    layer.scale.weight_loader(layer.scale, s)


def _stack(seed: int) -> Mxfp4ExpertStack:
    stack = Mxfp4ExpertStack(EXPERTS, IN, OUT, (OUT,), EXACT)
    for expert in range(EXPERTS):
        packed, scale = quantize_mxfp4(torch.randn(OUT, IN, generator=_gen(seed + expert)))
        stack.weight.weight_loader(stack.weight, packed, (expert, 0))
        stack.scale.weight_loader(stack.scale, scale, (expert, 0))
    return stack


def _x(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, IN, generator=_gen(seed)).to(torch.bfloat16)


def test_exact_mode_keeps_weights_only_on_the_cpu() -> None:
    exact, fp32 = DequantizedCache(EXACT), DequantizedCache(ComputeMode.FP32)
    assert exact.keeps(torch.device("cpu")) and not exact.keeps(torch.device("cuda", 0))
    assert fp32.keeps(torch.device("cuda", 0))
    layer = Fp8BlockLinear(IN, OUT, EXACT)
    _load_fp8(layer, seed=1)
    assert layer.dequantized_weight() is layer.dequantized_weight()  # computed once, then kept


def test_fp8_linear_follows_reloads_and_in_place_writes() -> None:
    layer = Fp8BlockLinear(IN, OUT, EXACT)
    x = _x(5, seed=2)
    _load_fp8(layer, seed=3)
    assert_bitwise_equal(layer(x), fp8_block_gemm(x, layer.weight, layer.scale))
    _load_fp8(layer, seed=4)  # the weight loaders write through ``.data`` and clear the kept weights
    assert_bitwise_equal(layer(x), fp8_block_gemm(x, *_fp8_weight(4)))
    q, s = _fp8_weight(5)
    with torch.no_grad():  # a plain in-place write: only the version counters tell
        layer.weight.copy_(q)
        layer.scale.copy_(s)
    assert_bitwise_equal(layer(x), fp8_block_gemm(x, q, s))


def test_expert_stack_follows_an_eplb_rearrangement() -> None:
    stack = _stack(seed=10)
    x = _x(7, seed=11)
    slots = torch.tensor([0, 3, -1, 1, 2, 3, 0])
    before = [(stack.weight[e].clone(), stack.scale[e].clone()) for e in range(EXPERTS)]
    assert_bitwise_equal(stack.grouped(x, ExpertRows(slots)), mxfp4_grouped_gemm(x, slots, stack.weight, stack.scale))
    assert_bitwise_equal(stack(x, 2), mxfp4_gemm(x, *before[2]))
    # Rearrange the slots in place the way expert-parallel rebalancing does: byte views through ``detach``.
    placement = [2, 0, 3, 1]
    views = [tensor.detach().view(torch.uint8) for tensor in stack.parameters()]
    rearrange_expert_weights(views, list(range(EXPERTS)), placement, RankGroup.single())
    stored = [(torch.stack([before[e][i] for e in placement])) for i in (0, 1)]
    assert torch.equal(stack.weight, stored[0]) and torch.equal(
        stack.scale.view(torch.uint8), stored[1].view(torch.uint8)
    )
    assert_bitwise_equal(stack.grouped(x, ExpertRows(slots)), mxfp4_grouped_gemm(x, slots, *stored))
    stack.set_local_experts(placement)
    for expert in range(EXPERTS):
        assert_bitwise_equal(stack(x, expert), mxfp4_gemm(x, *before[expert]))


def test_expert_stack_follows_a_reload_of_one_expert() -> None:
    stack = _stack(seed=20)
    x = _x(4, seed=21)
    slots = torch.tensor([1, 1, 0, 3])
    stack.grouped(x, ExpertRows(slots))
    packed, scale = quantize_mxfp4(torch.randn(OUT, IN, generator=_gen(22)))
    stack.weight.weight_loader(stack.weight, packed, (1, 0))
    stack.scale.weight_loader(stack.scale, scale, (1, 0))
    assert_bitwise_equal(stack.grouped(x, ExpertRows(slots)), mxfp4_grouped_gemm(x, slots, stack.weight, stack.scale))
    assert_bitwise_equal(stack(x, 1), mxfp4_gemm(x, packed, scale))
