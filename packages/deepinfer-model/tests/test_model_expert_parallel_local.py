"""Storing and loading only some routed experts (an expert-parallel rank's share), in one process."""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import PREFIX, layer0_moe, layer0_weights, tiny_config

from deepinfer_model.deepseek_v41.weight_loading import load_named_weights
from deepinfer_model.layers.linear import Mxfp4ExpertStack
from deepinfer_model.layers.mode import ComputeMode


def test_only_local_experts_are_stored_and_loaded() -> None:
    # Expert 5 twice (a replica) and expert 2; the other experts' tensors are skipped, not reported as unknown.
    root = layer0_moe((5, 2, 5))
    load_named_weights(root, layer0_weights().items())
    stack = root.layers[0].ffn.experts.w2
    assert isinstance(stack, Mxfp4ExpertStack)
    assert stack.weight.shape[0] == 3 and stack.local_experts == (5, 2, 5)
    weights = layer0_weights()
    for slot, expert in enumerate((5, 2, 5)):
        assert torch.equal(stack.weight[slot], weights[f"{PREFIX}experts.{expert}.w2.weight"])
    assert stack.holds(2) and not stack.holds(0)


def test_a_missing_local_expert_is_still_an_error() -> None:
    root = layer0_moe((5, 2))
    weights = layer0_weights()
    del weights[f"{PREFIX}experts.2.w3.scale"]
    with pytest.raises(ValueError, match="not loaded"):
        load_named_weights(root, weights.items())


def test_computing_an_expert_held_elsewhere_raises() -> None:
    root = layer0_moe((5, 2), ComputeMode.FP32)
    load_named_weights(root, layer0_weights().items())
    x = torch.randn(3, tiny_config().text.hidden_size)
    with pytest.raises(ValueError, match="expert 0 is not held"):
        root.layers[0].ffn.experts.compute(0, x, torch.ones(3))


@pytest.mark.parametrize("local_experts", [(), (8,), (-1, 2)])
def test_bad_local_experts_raise(local_experts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="local_experts"):
        Mxfp4ExpertStack(8, 32, 64, (64,), ComputeMode.EXACT, local_experts)
