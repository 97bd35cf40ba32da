"""Speculative decoding keeps the sampling distribution: with DSpark drafts (many of them accepted), sampled tokens
follow the target model's distribution (CPU, tiny checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts
from scipy.stats import kstest

from deepinfer_engine import SamplingParams
from deepinfer_model.forward_batch import ForwardBatch


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def test_sampled_tokens_with_drafts_follow_the_target_distribution(root: Path) -> None:
    # Many seeds, one prompt: the token at output index 1 is the first one decided by verification (accepted draft
    # or residual sample; about 40 % of the drafts are accepted here). Its randomized probability integral transform
    # under the target distribution given (prompt, token 0) must be uniform.
    num = 400
    prompt = random_prompts(1, 12, 12, seed=9)[0]
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seq_seed=1000 + i) for i in range(num)]
    llm = make_llm(root, precision="fp32", nextn=2, max_num_seqs=64, num_cache_blocks=512)
    outputs = llm.generate(prompt_token_ids=[prompt] * num, sampling_params=params, use_tqdm=False)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in outputs)
    verified = sum(o.metrics.num_verified_draft_tokens for o in outputs)
    assert verified >= num and 0.1 * verified < accepted < 0.9 * verified

    contexts = [[*prompt, o.token_ids[0]] for o in outputs]
    model = llm.engine.model
    state = model.allocate_state(16, num + 1, num + 1)
    table = torch.arange(1, num + 1, dtype=torch.int32)[:, None]
    with torch.inference_mode():
        logits = model(ForwardBatch.for_requests(contexts, [0] * num, table, list(range(1, num + 1))), state)
    last_rows = torch.arange(1, num + 1) * len(contexts[0]) - 1
    # Tokens ordered by descending target probability: a sample that ignores the target lands high in [0, 1).
    probs, order = torch.softmax(logits[last_rows].double(), dim=-1).sort(dim=-1, descending=True)
    ranks = (order == torch.tensor([o.token_ids[1] for o in outputs])[:, None]).double().argmax(dim=-1, keepdim=True)
    own = probs.gather(1, ranks)[:, 0]
    jitter = torch.rand(num, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pit = torch.cumsum(probs, dim=-1).gather(1, ranks)[:, 0] - own + jitter * own
    assert kstest(pit.numpy(), "uniform").pvalue > 0.01
