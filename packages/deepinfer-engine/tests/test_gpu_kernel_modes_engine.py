"""The kernel modes of NVIDIA that change how kernels launch, not what they compute (docs/design/kernels.md):
dependent launches (``EngineArgs.dependent_launch``: every Triton kernel waits for the kernels before it before it
touches memory; by default in the forwards of at most 64 tokens) and branch streams (``EngineArgs.branch_streams``:
independent branches of a layer on side streams). On the built-in checkpoint with CUDA graphs (decode) and eager
prefill chunks, a batch of mixed requests gives bitwise the same greedy tokens and log-probs (with their top 20
alternatives) with the mode as without it; with drafting too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HELD_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "tiny_heldout.jsonl"


def _prompts(num: int) -> list[str]:
    lines = HELD_OUT.read_text(encoding="utf-8").splitlines()[:num]
    return [json.loads(line)["prompt"] for line in lines]


MODES = ("dependent_launch", "branch_streams")


def _run(root: Path, mode: str, on: bool | None, nextn: int) -> list[tuple[Any, ...]]:
    llm = LLM(
        device="cuda",
        nextn=nextn,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=16,
        num_cache_blocks=1024,
        cache_dir=str(root),
        **{mode: on},
    )
    try:
        assert getattr(llm.model, mode) is (on is True)
        params = [
            SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True, top_logprobs=20) for i in range(16)
        ]
        outputs = llm.generate(_prompts(16), params)
    finally:
        llm.close()
    assert all(output.ok for output in outputs)
    return [(output.token_ids, output.logprobs, output.top_logprobs) for output in outputs]


@pytest.mark.parametrize("nextn", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_the_mode_gives_the_same_bits(tmp_path: Path, mode: str, nextn: int) -> None:
    assert _run(tmp_path, mode, True, nextn) == _run(tmp_path, mode, False, nextn)


def test_automatic_dependent_launches_give_the_same_bits(tmp_path: Path) -> None:
    """The default (``dependent_launch=None``): dependent launches in the forwards of at most 64 tokens (every decode
    graph here, the short prompt chunks), the same bits as none."""
    assert _run(tmp_path, "dependent_launch", None, 0) == _run(tmp_path, "dependent_launch", False, 0)
