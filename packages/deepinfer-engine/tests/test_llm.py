"""LLM.generate end to end on the tiny checkpoint (CPU): greedy parity with the reference model (also under
preemption), seeds, async == sync, logprobs, stop conditions, the tiny-checkpoint cache and engine arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import EOS, make_llm, random_prompts, reference_greedy, tiny_dir

from deepinfer_engine import LLM, FinishReason, SamplingParams


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


@pytest.fixture(scope="module")
def llm(root: Path) -> LLM:
    return make_llm(root)


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def test_greedy_equals_reference_token_by_token_also_with_preemption(root: Path) -> None:
    # FP32 compute mode on both sides: the layered model and the reference then agree up to summation order.
    prompts = random_prompts(16, 3, 40, seed=0)
    expected = reference_greedy(root, prompts, GREEDY.max_tokens)
    roomy = make_llm(root, precision="fp32")
    outputs = roomy.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == expected
    tight = make_llm(root, precision="fp32", block_size=4, num_cache_blocks=20)
    pressured = tight.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in pressured) > 0, "the tiny cache should force preemption"
    assert [list(o.token_ids) for o in pressured] == expected
    assert tight.engine.cache_manager.num_free_blocks == tight.engine.cache_manager.num_usable_blocks


def test_outputs_in_input_order_with_text_logprobs_and_metrics(llm: LLM) -> None:
    prompts = ["Hello world", "The capital of France is", "def f(x):"]
    params = SamplingParams(temperature=0.8, max_tokens=4, top_logprobs=3, seq_seed=11, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert output.finish_reason is FinishReason.LENGTH and output.ok
        assert len(output.token_ids) == 4 and len(output.logprobs) == 4
        assert output.text == llm.tokenizer.decode(list(output.token_ids))
        assert all(len(top) == 3 for top in output.top_logprobs)
        for token, logprob, top in zip(output.token_ids, output.logprobs, output.top_logprobs, strict=True):
            assert logprob <= 0.0
            assert top[0][1] >= top[1][1] >= top[2][1]
            assert logprob <= top[0][1] + 1e-6
            if token == top[0][0]:
                assert logprob == pytest.approx(top[0][1])
        assert output.metrics.time_to_first_token_s is not None and output.metrics.time_to_first_token_s > 0
        assert output.metrics.decode_tokens_per_s is not None and output.metrics.decode_tokens_per_s > 0
        assert output.metrics.num_prompt_tokens == len(output.prompt_token_ids)
        assert output.prompt_token_ids[0] == 0  # BOS prepended by the release policy


def test_shared_params_give_each_prompt_its_own_stream_and_seq_seed_reproduces(llm: LLM) -> None:
    prompt = [[5, 6, 7, 8]] * 4
    shared = SamplingParams(temperature=1.0, max_tokens=6, seq_seed=1234, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=shared, use_tqdm=False)]
    assert len(set(first)) > 1, "one shared SamplingParams must not give every prompt the same random stream"
    again = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=shared, use_tqdm=False)]
    assert again == first
    unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    a = llm.generate(prompt_token_ids=prompt[:1], sampling_params=unseeded, use_tqdm=False)[0].token_ids
    b = llm.generate(prompt_token_ids=prompt[:1], sampling_params=unseeded, use_tqdm=False)[0].token_ids
    assert a != b, "without seq_seed successive requests draw from the engine seed and request counter"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_async_scheduling_equals_sync(root: Path, temperature: float) -> None:
    prompts = random_prompts(10, 2, 30, seed=3)
    params = [
        SamplingParams(temperature=temperature, max_tokens=3 + i % 4, seq_seed=i, repetition_penalty=1.0 + (i % 2))
        for i in range(len(prompts))
    ]
    results = []
    for async_scheduling in (False, True):
        engine = make_llm(root, async_scheduling=async_scheduling, block_size=8, num_cache_blocks=20)
        outputs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results.append([(o.token_ids, o.finish_reason) for o in outputs])
    assert results[0] == results[1]


def test_stop_string_stop_token_and_eos(llm: LLM) -> None:
    prompts = [[9, 10, 11]]
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = list(llm.generate(prompt_token_ids=prompts, sampling_params=free_params, use_tqdm=False)[0].token_ids)
    stop_token = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(tokens[2],), ignore_eos=True)
    out = llm.generate(prompt_token_ids=prompts, sampling_params=stop_token, use_tqdm=False)[0]
    assert list(out.token_ids) == tokens[: tokens.index(tokens[2]) + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == tokens[2]
    text = llm.tokenizer.decode(tokens)
    # A character first seen after the start of the text (not a partial UTF-8 replacement character).
    index = next(i for i, c in enumerate(text) if i > 0 and c != "\ufffd" and c not in text[:i])
    stop = text[index]
    with_stop = SamplingParams(temperature=0, max_tokens=12, stop=(stop,), ignore_eos=True)
    out = llm.generate(prompt_token_ids=prompts, sampling_params=with_stop, use_tqdm=False)[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == text[:index] and len(out.token_ids) < len(tokens)
    assert list(out.token_ids) == tokens[: len(out.token_ids)]
    eos = SamplingParams(temperature=0, max_tokens=12, golden_token_ids=(tokens[0], EOS))
    out = llm.generate(prompt_token_ids=prompts, sampling_params=eos, use_tqdm=False)[0]
    assert list(out.token_ids) == [tokens[0], EOS] and out.finish_reason is FinishReason.STOP


def test_tiny_checkpoint_is_written_once_into_the_cache(root: Path) -> None:
    directory = tiny_dir(root)
    assert directory.parent == root and directory.name.startswith("tiny-")
    assert tiny_dir(root) == directory
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "no scratch directory is left behind"
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


def test_dependent_launches_default_to_the_small_forwards(llm: LLM, root: Path) -> None:
    """``dependent_launch=None`` (the default) asks the model for dependent launches in forwards of at most
    ``DEPENDENT_LAUNCH_AUTO_TOKENS`` tokens; True in every forward, False in none."""
    from deepinfer_engine.engine_args import DEPENDENT_LAUNCH_AUTO_TOKENS

    assert (llm.model.dependent_launch, llm.model.dependent_launch_max_tokens) == (False, DEPENDENT_LAUNCH_AUTO_TOKENS)
    for on, expected in ((True, (True, 0)), (False, (False, 0))):
        other = make_llm(root, dependent_launch=on)
        try:
            assert (other.model.dependent_launch, other.model.dependent_launch_max_tokens) == expected
        finally:
            other.close()


def test_max_model_len_defaults_from_the_checkpoint(llm: LLM) -> None:
    assert llm.engine.config.scheduler.max_model_len == min(4096, 255 * 16 - 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 2}, "multi-rank execution is not wired"),
        ({"context_parallel_size": 0}, "context_parallel_size must be a positive int"),
        ({"max_model_len": 10**6}, "exceeds the checkpoint's max_position_embeddings"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"enforce_eager": "no"}, "enforce_eager must be a bool"),
        ({"dependent_launch": 1}, "dependent_launch must be a bool"),
        ({"branch_streams": "on"}, "branch_streams must be a bool"),
        ({"flashmla": None}, "flashmla must be a bool"),
    ],
)
def test_bad_engine_arguments(root: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(root, **kwargs)


def test_unknown_engine_argument(root: Path) -> None:
    with pytest.raises(TypeError, match="unknown engine arguments \\['bogus'\\]; known"):
        make_llm(root, bogus=1)
    with pytest.raises(TypeError, match=r"\['max_num_seq'\] \(did you mean max_num_seq -> max_num_seqs\?\)"):
        make_llm(root, max_num_seq=4)


def test_sampler_environment_variables_are_wired(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(3, 4, 12, seed=7)
    greedy = make_llm(root, precision="fp32").generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    first_tokens = sorted({o.token_ids[0] for o in greedy})
    monkeypatch.setenv("DEEPINFER_SAMPLER_FORCE_TOPK", "1")
    monkeypatch.setenv("DEEPINFER_DECODE_TOKEN_BLACKLIST", ",".join(str(t) for t in first_tokens))
    engine = make_llm(root, precision="fp32")
    assert engine.engine.config.sampler.force_top_k == 1
    sampled = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seq_seed=3)
    outputs = engine.generate(prompt_token_ids=prompts, sampling_params=sampled, use_tqdm=False)
    # Top-1 forcing makes sampling deterministic: the best token that is not banned.
    assert all(o.token_ids[0] not in first_tokens for o in outputs)
    again = engine.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seq_seed=4),
        use_tqdm=False,
    )
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    monkeypatch.setenv("DEEPINFER_DECODE_TOKEN_BLACKLIST", "9..3")
    with pytest.raises(ValueError, match=r"DEEPINFER_DECODE_TOKEN_BLACKLIST='9\.\.3' is invalid"):
        make_llm(root)


def test_concurrent_first_use_of_the_tiny_checkpoint(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # A first write elsewhere loads the kernels registry, whose lazy first load is not thread-safe.
    tiny_dir(tmp_path / "warm-up")
    cold = tmp_path / "cold"
    with ThreadPoolExecutor(max_workers=3) as pool:
        directories = list(pool.map(lambda _: tiny_dir(cold), range(3)))
    assert len(set(directories)) == 1
    assert [p.name for p in cold.iterdir()] == [directories[0].name]


def test_hub_id_resolves_through_deepinfer_hf_model_dir(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tiny_dir(root)))
    engine = make_llm(root, model="deepseek-ai/not-downloaded")
    assert engine.engine.config.model_dir == tiny_dir(root)


def test_progress_bar_and_summary_line(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(prompt_token_ids=[[5, 6], [7, 8, 9]], sampling_params=GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate: 2 requests, 5 prompt tokens, 6 generated tokens in " in err and "tok/s" in err
    llm.generate(prompt_token_ids=[[5, 6]], sampling_params=GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_prompt_logprobs_match_the_reference_across_prefill_chunks(root: Path) -> None:
    from tokenizers import Tokenizer

    from deepinfer_model.loading.load import load_checkpoint_dir
    from deepinfer_model.reference import engram_vocabulary_from_tokenizer, reference_forward

    prompts = random_prompts(3, 20, 40, seed=8)
    engine = make_llm(root, precision="fp32", max_num_batched_tokens=16)  # prompts are prefilled in chunks
    params = [
        SamplingParams(temperature=1.0, max_tokens=2, prompt_logprobs=True, seq_seed=1),
        SamplingParams(temperature=0.5, top_k=5, max_tokens=2, prompt_logprobs=True, seq_seed=2),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=True),
    ]
    outputs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    directory = tiny_dir(root)
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    for prompt, output in zip(prompts, outputs, strict=True):
        logits = reference_forward(
            checkpoint.config, checkpoint.tensors, torch.tensor(prompt), vocabulary, precision="fp32"
        )
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt) - 1
        got = torch.tensor(output.prompt_logprobs)
        targets = torch.tensor(prompt[1:])
        if output is outputs[1]:
            in_top5 = (logits[:-1].topk(5, dim=-1).indices == targets[:, None]).any(-1)
            assert torch.equal(got > -9999.0, in_top5)
        else:  # temperature 1 (processed = the model's own) and greedy (the model's own, not a one-hot 0 / -9999)
            expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, targets[:, None])[:, 0]
            torch.testing.assert_close(got, expected.clamp(min=-9999.0), rtol=0, atol=1e-4)
    assert make_llm(root).generate(prompt_token_ids=prompts[:1], use_tqdm=False)[0].prompt_logprobs is None
