"""The batch-invariant CPU forward (docs/design/numerics.md, "Batch invariance"): with ``batch_invariant`` the logits
of a prompt alone and inside a prefill step of prompts of other lengths, at any position, are bit-identical; off
(the default) the forward is the default evaluation, which the flag changes in the last bits (FP32 mode: within
1e-4, summation order only; exact mode: BF16/FP8 rounding flips grow on the random checkpoint)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _layered_model_support import prompt, tiny_model

from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

BLOCK = 16


def _prefill(model: DeepseekV41ForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    num = len(prompts)
    width = -(-max(len(p) for p in prompts) // BLOCK)
    state = model.allocate_state(BLOCK, num * width + 1, num + 1)
    table = torch.arange(1, num * width + 1, dtype=torch.int32).view(num, width)
    with torch.inference_mode():
        logits = model(ForwardBatch.for_requests(prompts, [0] * num, table, list(range(1, num + 1))), state)
    return list(logits.split([len(p) for p in prompts]))


def test_a_prompt_alone_and_inside_a_batch_has_the_same_logits() -> None:
    model = tiny_model(ComputeMode.EXACT)
    model.batch_invariant = True
    prompts = [prompt(length, seed=length).tolist() for length in (3, 21, 9, 40, 1, 17)]
    together = _prefill(model, prompts)
    shuffled = _prefill(model, prompts[::-1])[::-1]
    for index, ids in enumerate(prompts):
        alone = _prefill(model, [ids])[0]
        assert torch.equal(alone, together[index]), index
        assert torch.equal(shuffled[index], together[index]), index


@pytest.mark.parametrize("mode", [ComputeMode.EXACT, ComputeMode.FP32])
def test_the_flag_selects_the_invariant_evaluation(mode: ComputeMode) -> None:
    model = tiny_model(mode)
    assert not model.batch_invariant
    prompts = [prompt(length, seed=length).tolist() for length in (5, 30)]
    default = torch.cat(_prefill(model, prompts))
    model.batch_invariant = True
    invariant = torch.cat(_prefill(model, prompts))
    model.batch_invariant = False
    assert torch.equal(torch.cat(_prefill(model, prompts)), default)
    assert not torch.equal(invariant, default)
    if mode is ComputeMode.FP32:  # no rounding point to flip: the evaluations differ by summation order only
        torch.testing.assert_close(invariant, default, rtol=1e-4, atol=1e-4)


def test_the_accelerator_routing_keeps_the_forward_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA route of the mode (products through ``invariant_matmul``, here its FP64 reference on CPU tensors;
    reductions in FP64; transcendentals unchanged) taken on the CPU: every product of the forward decomposes into
    routed ``mm``/``bmm`` calls and a prompt's logits stay bit-identical alone and in a batch."""
    from deepinfer_kernels import batch_invariant

    routed: list[str] = []
    route = batch_invariant.invariant_product

    def counted(func: object, *args: object) -> object:
        routed.append(str(func))
        return route(func, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(batch_invariant, "_on_cpu", lambda args, kwargs: False)
    monkeypatch.setattr(batch_invariant, "invariant_product", counted)
    test_a_prompt_alone_and_inside_a_batch_has_the_same_logits()
    assert {"aten.mm.default", "aten.bmm.default"} <= set(routed)


def _watch_norms(monkeypatch: pytest.MonkeyPatch, requested: Callable[[], bool]) -> list[bool]:
    # What ``requested()`` says at each call of the kernels' RMSNorm, which every layer makes.
    import deepinfer_model.layers.norm as norm

    seen: list[bool] = []
    kernel = norm.rms_norm

    def observed(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(requested())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(norm, "rms_norm", observed)
    return seen


@pytest.mark.parametrize("flag", ["dependent_launch", "branch_streams"])
def test_the_launch_flags_reach_the_kernels_and_change_no_bits(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """``dependent_launch`` and ``branch_streams`` run the forward inside the kernels' ``dependent_launches`` and
    ``branch_streams`` (seen from the kernels' RMSNorm, which every layer calls), and on the CPU change nothing."""
    from deepinfer_kernels.branch_streams import branch_streams_requested
    from deepinfer_kernels.dependent_launch import dependent_launches_requested

    requested = {"dependent_launch": dependent_launches_requested, "branch_streams": branch_streams_requested}[flag]
    model = tiny_model(ComputeMode.EXACT)
    prompts = [prompt(length, seed=length).tolist() for length in (5, 30)]
    default = torch.cat(_prefill(model, prompts))
    seen = _watch_norms(monkeypatch, requested)
    setattr(model, flag, True)
    assert torch.equal(torch.cat(_prefill(model, prompts)), default)
    setattr(model, flag, False)
    _prefill(model, prompts)
    half = len(seen) // 2
    assert half and seen == [True] * half + [False] * half


def test_dependent_launches_reach_the_calls_of_at_most_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dependent_launch_max_tokens``: a call of at most that many tokens runs inside ``dependent_launches``, a
    longer one does not, with the same bits as without the limit (prompts of 5 and 30 tokens alone, limit 5)."""
    from deepinfer_kernels.dependent_launch import dependent_launches_requested

    model = tiny_model(ComputeMode.EXACT)
    prompts = [prompt(length, seed=length).tolist() for length in (5, 30)]
    default = [_prefill(model, [p])[0] for p in prompts]
    seen = _watch_norms(monkeypatch, dependent_launches_requested)
    model.dependent_launch_max_tokens = 5
    for p, logits in zip(prompts, default, strict=True):
        assert torch.equal(_prefill(model, [p])[0], logits)
    half = len(seen) // 2
    assert half and seen == [True] * half + [False] * half
