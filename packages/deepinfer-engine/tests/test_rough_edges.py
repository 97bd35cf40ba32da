"""What a new user trips over gets a clear answer: wrongly shaped prompt ids, a CUDA device without a GPU, an empty
checkpoint directory, a misspelt environment variable, a parallel `LLM` in a script without a `__main__` guard, and
log-probs of greedy requests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts, tiny_dir
from tokenizers import Tokenizer

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.envs import read_env
from deepinfer_model.loading.errors import CheckpointError
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference import engram_vocabulary_from_tokenizer, reference_forward


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


@pytest.fixture(scope="module")
def llm(root: Path) -> LLM:
    return make_llm(root, precision="fp32")


def test_flat_or_float_prompt_ids_are_a_type_error(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"flat list of ints; for one prompt pass \[\[id, id, \.\.\.\]\]"):
        llm.generate(prompt_token_ids=[5, 6, 7], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\]\[0\] must be an int token id, got 5.0 \(float\)"):
        llm.generate(prompt_token_ids=[[5, 6], [5.0, 6.0]], use_tqdm=False)  # type: ignore[list-item]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"device='cuda', but no CUDA GPU is visible"):
        LLM(model=str(tmp_path / "never-looked-at"), device="cuda")


def test_empty_directory_is_a_checkpoint_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        LLM(model=str(tmp_path), device="cpu")


def test_misspelt_environment_variable_names_the_closest_one() -> None:
    with pytest.warns(UserWarning, match="DEEPINFER_BATCH_INVARIENT .* did you mean DEEPINFER_BATCH_INVARIANT"):
        read_env({"DEEPINFER_BATCH_INVARIENT": "1"})


def test_parallel_llm_in_a_script_without_a_main_guard_says_so(root: Path, tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from deepinfer_engine import LLM
            LLM(cache_dir={str(root)!r}, device="cpu", data_parallel_size=2, expert_parallel_size=2)
            """
        )
    )
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "rank processes are spawned and import the main module" in result.stderr, result.stderr[-2000:]
    assert 'must do so under `if __name__ == "__main__":`' in result.stderr, result.stderr[-2000:]


def test_greedy_log_probs_are_the_models_own(llm: LLM, root: Path) -> None:
    prompt = random_prompts(1, 6, 6, seed=31)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, top_logprobs=3)
    (output,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    directory = tiny_dir(root)
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    ids = torch.tensor(prompt)
    logits = reference_forward(checkpoint.config, checkpoint.tensors, ids, vocabulary, precision="fp32")
    expected = torch.log_softmax(logits[-1].float(), dim=-1)
    best = expected.topk(3)
    (token,) = output.token_ids
    assert token == int(best.indices[0])
    assert output.logprobs[0] == pytest.approx(float(expected[token]), abs=1e-3)
    assert -9999.0 < output.logprobs[0] < 0.0
    (top,) = output.top_logprobs
    assert [t for t, _ in top] == best.indices.tolist()
    assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-3)
