"""Expert parallelism of the layered model over NCCL, one process per GPU, attention DP (each rank its own request):
every rank's logits against the full model on its own GPU (FP32 mode, TF32 off; within 1e-4 relative, as the
single-GPU parity test allows, since GEMMs see other row batches).

Needs at least two CUDA devices; skipped otherwise. The random checkpoint is generated once in the parent with the
PyTorch reference kernels (the writer quantizes CPU tensors) and handed to the ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _layered_model_support import chunk_batch, prompt, tiny_config, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM, ExpertParallelMoE
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups
from deepinfer_parallel.launcher import spawn

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TOLERANCE = 1e-4


def _to_cuda(batch: ForwardBatch) -> ForwardBatch:
    tensors = {
        name: getattr(batch, name).cuda()
        for name in ("input_ids", "positions", "cu_query_lens", "context_lens", "block_table", "state_slots")
    }
    prefix = None if batch.engram_prefix_ids is None else batch.engram_prefix_ids.cuda()
    return ForwardBatch(
        **tensors, engram_prefix_ids=prefix, max_query_len=batch.max_query_len, max_context_len=batch.max_context_len
    )


def _run(model: DeepseekV41ForCausalLM, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    state = model.allocate_state(block_size=8, num_blocks=8, num_state_slots=1, device="cuda")
    table = torch.arange(8, dtype=torch.int32)[None, :]
    with torch.no_grad():
        steps = itertools.pairwise(bounds)
        return torch.cat([model(_to_cuda(chunk_batch(ids, a, b, table, 0)), state).cpu() for a, b in steps])


def _nccl_rank(rank: int, world_size: int, weights: dict[str, torch.Tensor]) -> None:
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    text = tiny_config().text
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    ep = ExpertParallelMoE.create(groups, text.n_routed_experts, text.num_hidden_layers, 0, torch.device("cuda", rank))
    sharded = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab(), expert_parallel=ep)
    full = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab())
    for model in (sharded, full):
        model.load_weights(weights.items())
        model.cuda()
    length = 20 + 5 * rank
    ids = prompt(length, seed=30 + rank)
    bounds = [0, length - 2, length - 1, length]
    got, expected = _run(sharded, ids, bounds), _run(full, ids, bounds)
    error = float((got - expected).abs().max() / expected.abs().max())
    if not error <= TOLERANCE:
        raise AssertionError(f"rank {rank}: relative error {error:.3g} > {TOLERANCE}")


def test_expert_parallel_over_nccl_matches_the_full_model() -> None:
    from deepinfer_kernels import _registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_ACCELERATOR", "cpu")
        _registry.reset()
        weights = dict(tiny_weights())
    _registry.reset()
    spawn(_nccl_rank, 2, args=(weights,), backend="nccl", timeout_s=120.0)
