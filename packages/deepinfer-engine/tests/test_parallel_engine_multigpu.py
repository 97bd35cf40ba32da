"""Data-/expert-parallel `LLM` on GPUs: dp = ep = 2, rank r on cuda:r over NCCL, gives the greedy tokens of one
GPU for mixed-length prompts (more prompts than ranks, and a call that leaves one rank idle).

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

_PROMPTS = random_prompts(6, 2, 40, seed=23)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_dp2_ep2_on_two_gpus_matches_one_gpu(tmp_path: Path) -> None:
    single = make_llm(tmp_path, device="cuda")
    expected = [tuple(o.token_ids) for o in single.generate(prompt_token_ids=_PROMPTS, sampling_params=_GREEDY)]
    single.close()
    del single
    torch.cuda.empty_cache()
    parallel = make_llm(tmp_path, device="cuda", data_parallel_size=2, expert_parallel_size=2)
    try:
        got = parallel.generate(prompt_token_ids=_PROMPTS, sampling_params=_GREEDY)
        alone = parallel.generate(prompt_token_ids=_PROMPTS[:1], sampling_params=_GREEDY)
    finally:
        parallel.close()
    assert [len(o.token_ids) for o in got] == [_GREEDY.max_tokens] * len(_PROMPTS)
    assert [tuple(o.token_ids) for o in got] == expected
    assert tuple(alone[0].token_ids) == expected[0]
