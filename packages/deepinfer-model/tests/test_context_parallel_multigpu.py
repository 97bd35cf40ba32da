"""Context-parallel prefill of the layered model over NCCL, one process per GPU (cp = 2): every rank's logits, greedy
tokens and cache contents against the unsplit model on its own GPU (FP32 mode, TF32 off; within 1e-4 relative, as
the single-GPU parity test allows, since GEMMs see other row batches). The schedule is the CPU tests' one
(``_context_parallel_support``).

Needs at least two CUDA devices; skipped otherwise. The random checkpoint is generated once in the parent with the
PyTorch reference kernels (the writer quantizes CPU tensors) and handed to the ranks.
"""

from __future__ import annotations

import pytest
import torch
from _context_parallel_support import run_schedule
from _layered_model_support import tiny_config, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups
from deepinfer_parallel.launcher import spawn

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TOLERANCE = 1e-4


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _nccl_rank(rank: int, world_size: int, weights: dict[str, torch.Tensor]) -> None:
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    config = ParallelConfig(world_size=world_size, data_parallel_size=1, context_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    split = DeepseekV41ForCausalLM(
        tiny_config(), ComputeMode.FP32, tiny_vocab(), context_parallel=groups.context_parallel
    )
    whole = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab())
    for model in (split, whole):
        model.load_weights(weights.items())
        model.cuda()
    logits, greedy, _, contents = run_schedule(split, seed=5, device="cuda")
    want_logits, want_greedy, _, want_contents = run_schedule(whole, seed=5, device="cuda")
    if greedy != want_greedy:
        raise AssertionError(f"rank {rank}: greedy tokens {greedy} != unsplit {want_greedy}")
    for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        if not _relative(got, want) <= TOLERANCE:
            raise AssertionError(f"rank {rank} step {step}: relative error {_relative(got, want):.3g} > {TOLERANCE}")
    for key, want in want_contents.items():
        if not _relative(contents[key], want) <= TOLERANCE:
            raise AssertionError(f"rank {rank} cache {key}: relative error {_relative(contents[key], want):.3g}")


def test_context_parallel_over_nccl_matches_the_unsplit_model() -> None:
    from deepinfer_kernels import _registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_ACCELERATOR", "cpu")
        _registry.reset()
        weights = dict(tiny_weights())
    _registry.reset()
    spawn(_nccl_rank, 2, args=(weights,), backend="nccl", timeout_s=120.0)
