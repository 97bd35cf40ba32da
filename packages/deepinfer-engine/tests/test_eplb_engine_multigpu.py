"""EPLB on GPUs: dp = ep = 2 over NCCL (load window on the device, window summed with an NCCL all-reduce, expert
weights moved with NCCL point-to-point) gives the greedy tokens of the same engine without EPLB, after rearrangements
that moved experts. Exact equality as in test_parallel_engine_multigpu (the tiny checkpoint's greedy tokens have
held across batchings there); replicas split an expert's rows over two GEMMs, so a difference with near-equal top
log-probs would be GPU batch variance, not EPLB.

Needs at least two CUDA devices; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts

from deepinfer_sampling import SamplingParams

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

_PROMPTS = random_prompts(6, 2, 40, seed=29)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_eplb_on_two_gpus_keeps_the_greedy_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = make_llm(tmp_path, device="cuda", data_parallel_size=2, expert_parallel_size=2)
    try:
        expected = [tuple(o.token_ids) for o in baseline.generate(prompt_token_ids=_PROMPTS, sampling_params=_GREEDY)]
    finally:
        baseline.close()
    monkeypatch.setenv("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "2")
    monkeypatch.setenv("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE", "2")
    monkeypatch.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "2")
    monkeypatch.setenv("DEEPINFER_REARRANGE_P2P_GROUPS", "2")
    balanced = make_llm(tmp_path, device="cuda", data_parallel_size=2, expert_parallel_size=2)
    try:
        got = [tuple(o.token_ids) for o in balanced.generate(prompt_token_ids=_PROMPTS, sampling_params=_GREEDY)]
        stats = balanced.eplb_stats()
    finally:
        balanced.close()
    assert got == expected
    assert len(stats) == 2 and stats[0] == stats[1]
    assert stats[0].num_rearrangements >= 2
    assert any(r.num_moved_slots > 0 for r in stats[0].rearrangements)
