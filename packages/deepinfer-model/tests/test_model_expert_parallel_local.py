"""Storing and loading only some routed experts (an expert-parallel rank's share), in one process."""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import tiny_config, tiny_weights
from torch import nn

from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_model.deepseek_v41.weight_loading import load_named_weights
from deepinfer_model.layers.linear import Mxfp4ExpertStack
from deepinfer_model.layers.mode import ComputeMode

PREFIX = "layers.0.ffn."


def _layer0_moe(local_experts: tuple[int, ...], mode: ComputeMode = ComputeMode.EXACT) -> nn.Module:
    """A module tree whose only block is ``layers.0.ffn``, so checkpoint names map onto it unchanged."""
    t = tiny_config().text
    moe = MoE(
        t.hidden_size,
        t.moe_intermediate_size,
        t.n_routed_experts,
        t.num_experts_per_tok,
        t.n_shared_experts,
        t.routed_scaling_factor,
        t.swiglu_limit,
        mode,
        local_experts=local_experts,
    )
    block = nn.Module()
    block.ffn = moe
    root = nn.Module()
    root.layers = nn.ModuleList([block])
    return root


def _layer0_weights() -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in tiny_weights().items() if name.startswith(PREFIX)}


def test_only_local_experts_are_stored_and_loaded() -> None:
    # Expert 5 twice (a replica) and expert 2; the other experts' tensors are skipped, not reported as unknown.
    root = _layer0_moe((5, 2, 5))
    load_named_weights(root, _layer0_weights().items())
    stack = root.layers[0].ffn.experts.w2
    assert isinstance(stack, Mxfp4ExpertStack)
    assert stack.weight.shape[0] == 3 and stack.local_experts == (5, 2, 5)
    weights = _layer0_weights()
    for slot, expert in enumerate((5, 2, 5)):
        assert torch.equal(stack.weight[slot], weights[f"{PREFIX}experts.{expert}.w2.weight"])
    assert stack.holds(2) and not stack.holds(0)


def test_a_missing_local_expert_is_still_an_error() -> None:
    root = _layer0_moe((5, 2))
    weights = _layer0_weights()
    del weights[f"{PREFIX}experts.2.w3.scale"]
    with pytest.raises(ValueError, match="not loaded"):
        load_named_weights(root, weights.items())


def test_computing_an_expert_held_elsewhere_raises() -> None:
    root = _layer0_moe((5, 2), ComputeMode.FP32)
    load_named_weights(root, _layer0_weights().items())
    x = torch.randn(3, tiny_config().text.hidden_size)
    with pytest.raises(ValueError, match="expert 0 is not held"):
        root.layers[0].ffn.experts.compute(0, x, torch.ones(3))


@pytest.mark.parametrize("local_experts", [(), (8,), (-1, 2)])
def test_bad_local_experts_raise(local_experts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="local_experts"):
        Mxfp4ExpertStack(8, 32, 64, (64,), ComputeMode.EXACT, local_experts)
