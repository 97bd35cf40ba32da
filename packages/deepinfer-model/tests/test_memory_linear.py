"""Memory linear in context (docs/design/attention.md, "Sparse attention"): no intermediate of a step grows with
tokens × cached rows — the attention reads its keys as row lists into the cache pools and the indexer streams the
index-K rows, so a step's largest tensor depends on its token count, not on how much context lies behind it.

The test runs the same 256-token chunk of the tiny preset at the start of a request and at the end of its
``max_position_embeddings`` (4096) context, with the reference ops' workspaces shrunk (attention queries and indexer
query/row chunks then stay within 1 MiB), and records every tensor the forward creates. The largest one must not
grow with the context: a [tokens, rows] FP32 tensor at the long context would be 4 MiB (and the old
[tokens, rows, d] key gather 512 MiB), while the largest tensor of the short step is a 2.5 MiB dequantized weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import deepinfer_kernels.reference.attention as reference_attention
import deepinfer_kernels.reference.indexer as reference_indexer
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

TOKENS = 256
BLOCK_SIZE = 64


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor storage any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.what = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes() > self.nbytes:
                self.nbytes = tensor.untyped_storage().nbytes()
                self.what = f"{func} -> {tuple(tensor.shape)} {tensor.dtype}"
        return out


def _largest_tensor(model: DeepseekV41ForCausalLM, start: int) -> _LargestTensor:
    """The largest tensor of one step computing positions ``start … start + TOKENS − 1`` of a request whose earlier
    rows are in the (zeroed) cache."""
    context = tiny_config().text.max_position_embeddings
    num_blocks = context // BLOCK_SIZE
    state = model.allocate_state(block_size=BLOCK_SIZE, num_blocks=num_blocks, num_state_slots=1)
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    ids = prompt(TOKENS, seed=start).tolist()
    batch = ForwardBatch.for_requests([ids], [start], table, [0], engram_prefix_ids=torch.tensor([[5, 6]]))
    with torch.no_grad(), _LargestTensor() as largest:
        model(batch, state)
    return largest


def test_largest_step_tensor_does_not_grow_with_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_attention, "WORKSPACE_BYTES", 1 << 20)
    monkeypatch.setattr(reference_indexer, "_WORKSPACE_BYTES", 1 << 20)
    monkeypatch.setattr(reference_indexer, "_ROW_CHUNK", 256)
    model = tiny_model(ComputeMode.EXACT)
    _largest_tensor(model, 0)  # first step: the weights' dequantized copies are made once here
    short = _largest_tensor(model, 0)
    long = _largest_tensor(model, tiny_config().text.max_position_embeddings - TOKENS)
    assert short.nbytes <= 3 << 20, short.what
    assert long.nbytes <= short.nbytes, f"context 4096: {long.what}; context {TOKENS}: {short.what}"
