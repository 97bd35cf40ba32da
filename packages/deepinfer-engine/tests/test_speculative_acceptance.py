"""Acceptance of DSpark drafting on the built-in checkpoint (CPU): at temperature 0 drafting with every draft verified
(fixed) and with confidence-scheduled verification (varlen, its decode cost curve measured into a temporary cache
directory) emits exactly the tokens of decoding without drafts, for batches of 1, 7 and 32 prompts, under synchronous
and asynchronous scheduling; at temperature > 0 the first and second generated tokens follow the target distribution
with either; the planner verifies by confidence; the cost curve is cached and expires."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts
from scipy.stats import kstest

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.request import Request, RequestStatus, StopCriteria
from deepinfer_engine.verify_plan import plan_verified_drafts
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_sampling.speculative import DecodeCostCurve

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NEXTN = 5  # the reference's default
BATCHES = (1, 7, 32)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _engine(root: Path, varlen: bool, async_scheduling: bool, nextn: int = NEXTN) -> LLM:
    # FP32 compute mode: verify steps of several rows and one-row steps then agree up to summation order.
    return make_llm(root, precision="fp32", nextn=nextn, mtp_varlen=varlen, async_scheduling=async_scheduling)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert all(o.ok for o in outputs)
    return [o.token_ids for o in outputs]


def test_greedy_with_drafts_fixed_and_varlen_equals_greedy_without(root: Path) -> None:
    prompts = {n: random_prompts(n, 2, 24, seed=100 + n) for n in BATCHES}
    plain = make_llm(root, precision="fp32")
    expected = {n: _greedy(plain, p) for n, p in prompts.items()}
    for varlen in (False, True):
        for async_scheduling in (False, True):
            llm = _engine(root, varlen, async_scheduling)
            assert (llm.engine.scheduler.verify_cost is not None) == varlen
            for n, batch in prompts.items():
                assert _greedy(llm, batch) == expected[n], (varlen, async_scheduling, n)
    assert list((root / "decode_perf").iterdir()), "the varlen engines cached their decode cost curve"


def _pit(llm: LLM, contexts: list[list[int]], tokens: list[int], temperature: float) -> torch.Tensor:
    """Randomized probability integral transform of each token under the target's next-token distribution."""
    model = llm.engine.model
    num = len(contexts)
    width = -(-max(len(c) for c in contexts) // 16)
    state = model.allocate_state(16, num * width + 1, num + 1)
    table = torch.arange(1, num * width + 1, dtype=torch.int32).view(num, width)
    with torch.inference_mode():
        logits = model(ForwardBatch.for_requests(contexts, [0] * num, table, list(range(1, num + 1))), state)
    last_rows = torch.tensor([len(c) for c in contexts]).cumsum(0) - 1
    probs, order = torch.softmax(logits[last_rows].double() / temperature, dim=-1).sort(dim=-1, descending=True)
    ranks = (order == torch.tensor(tokens)[:, None]).double().argmax(dim=-1, keepdim=True)
    own = probs.gather(1, ranks)[:, 0]
    jitter = torch.rand(num, generator=torch.Generator().manual_seed(len(tokens)), dtype=torch.float64)
    return torch.cumsum(probs, dim=-1).gather(1, ranks)[:, 0] - own + jitter * own


@pytest.mark.parametrize("varlen", [False, True])
def test_sampled_tokens_with_drafts_follow_the_target_distribution(
    root: Path, varlen: bool, flat_decode_cost: None
) -> None:
    # Many seeds on one short prompt. Token 1 is the first one decided by verification (an accepted draft or a
    # residual sample), token 2 is often an accepted second draft. Given the tokens before it, each one's randomized
    # PIT under the target distribution is uniform and independent of the other's, so all 2N values together are
    # uniform on [0, 1): a KS test at p > 0.001 fails a correct engine once in a thousand runs.
    num, temperature = 200, 0.8
    prompt = random_prompts(1, 6, 6, seed=21)[0]
    params = [
        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seq_seed=5000 + i) for i in range(num)
    ]
    llm = make_llm(root, precision="fp32", nextn=NEXTN, max_num_seqs=32, num_cache_blocks=512, mtp_varlen=varlen)
    outputs = llm.generate(prompt_token_ids=[prompt] * num, sampling_params=params, use_tqdm=False)
    verified = sum(o.metrics.num_verified_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in outputs)
    assert verified >= num // 2 and 0 < accepted < verified  # verification decided many of these tokens
    first = _pit(llm, [[*prompt, o.token_ids[0]] for o in outputs], [o.token_ids[1] for o in outputs], temperature)
    second = _pit(llm, [[*prompt, *o.token_ids[:2]] for o in outputs], [o.token_ids[2] for o in outputs], temperature)
    assert kstest(torch.cat([first, second]).numpy(), "uniform").pvalue > 0.001


def _decoding(request_id: str, confidences: list[float]) -> Request:
    request = Request(request_id, [5, 6, 7], StopCriteria(max_tokens=50, eos_token_id=1))
    request.set_status(RequestStatus.RUNNING)
    request.append_output_token(9, None, None)
    request.num_computed_tokens = request.num_tokens - 1
    request.draft_token_ids = [11] * len(confidences)
    request.draft_confidences = confidences
    return request


def test_the_planner_verifies_the_drafts_likely_to_survive() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100, max_num_draft_tokens=3)
    sure, doubtful = _decoding("sure", [0.99, 0.98, 0.97]), _decoding("doubtful", [0.1, 0.5, 0.5])
    # Extra rows are almost free up to 8 tokens, then expensive: the planner fills the cheap rows with the best
    # estimates (sure: 3 drafts; doubtful's first draft, 0.1, beats its second, 0.05) and stops there.
    cost = DecodeCostCurve((2, 6, 8), (10.0, 10.5, 40.0))
    assert plan_verified_drafts([sure, doubtful], config, cost) == {"sure": 3, "doubtful": 1}
    # When every extra row costs half the step overhead, only drafts that are sure enough pay off.
    linear = DecodeCostCurve((1, 2, 3, 4, 5, 6, 7, 8), tuple(20.0 + 10.0 * n for n in range(1, 9)))
    assert plan_verified_drafts([sure, doubtful], config, linear) == {"sure": 3, "doubtful": 0}
    # A request in flight whose confidences are not known yet counts every draft as sure.
    unknown = _decoding("unknown", [])
    unknown.num_output_placeholders, unknown.num_computed_tokens = 1, unknown.num_tokens  # one step in flight
    assert plan_verified_drafts([unknown], config, cost)["unknown"] == 3


def test_the_cost_curve_is_cached_and_expires(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = root / "curve-cache"
    monkeypatch.setenv("DEEPINFER_DECODE_PERF_CACHE_DIR", str(cache))
    first = _engine(root, varlen=True, async_scheduling=False, nextn=2).engine.scheduler.verify_cost
    (written,) = list(cache.iterdir())
    again = _engine(root, varlen=True, async_scheduling=False, nextn=2).engine.scheduler.verify_cost
    assert again == first and list(cache.iterdir()) == [written]  # read back, not measured again
    assert first is not None and list(first.baseline_ms) == sorted(first.baseline_ms)
    # Past its validity the file is measured again; far past it, it is deleted.
    monkeypatch.setenv("DEEPINFER_DECODE_PERF_CACHE_TTL_SEC", "60")
    key, tag, _ = written.name.split(".")
    old = written.rename(cache / f"{key}.{tag}.{int(time.time()) - 3 * 3600}")
    (cache / "not-a-curve").write_text("{}")
    _engine(root, varlen=True, async_scheduling=False, nextn=2)
    remaining = list(cache.iterdir())
    assert old not in remaining and len(remaining) == 1 and os.path.basename(remaining[0]) != "not-a-curve"


def test_the_summary_line_shows_the_mean_acceptance_length(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm = make_llm(root, precision="fp32", nextn=2)
    outputs = llm.generate(prompt_token_ids=random_prompts(3, 3, 9, seed=4), sampling_params=GREEDY, use_tqdm=True)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in outputs)
    verified = sum(o.metrics.num_verified_draft_tokens for o in outputs)
    steps = sum(o.metrics.num_sampling_steps for o in outputs)
    assert verified > 0
    # Nothing cuts these outputs short: every step emitted its accepted drafts plus one token.
    assert steps == sum(o.metrics.num_generated_tokens for o in outputs) - accepted
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    length = 1 + accepted / steps
    assert summary.endswith(f", mean acceptance length {length:.2f} ({accepted} of {verified} drafts accepted)")
    make_llm(root).generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=True)
    assert "acceptance" not in capsys.readouterr().err  # nothing verified, nothing said


def test_confidence_head_temperatures_from_the_environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "0.5,0")
    assert make_llm(root, nextn=2).config.confidence_temperatures == (0.5, 1e-5)  # clamped at 1e-5
    for bad in ("0.5,1,2", "warm", "nan"):
        monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", bad)
        with pytest.raises(ValueError, match="DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"):
            make_llm(root, nextn=2)
    # A huge temperature makes every confidence 1/2: the planner then sees 1/2, 1/4 as the estimates.
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1e30")
    llm = make_llm(root, nextn=2, async_scheduling=False)
    seen: list[list[float]] = []
    scheduler = llm.engine.scheduler
    commit = scheduler._commit

    def recording_commit(request: Request, *args: object) -> object:
        seen.append(list(request.draft_confidences))
        return commit(request, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(scheduler, "_commit", recording_commit)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)
    assert seen and all(c == [0.5, 0.5] for c in seen)


def test_the_acceptance_length_stays_within_a_step_when_a_stop_string_cuts_outputs(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The built-in checkpoint's drafts run on past the newline that ends each answer: the tokens a step accepted after
    # the stop string are dropped. Counting steps keeps the mean at most nextn + 1 (generated / (generated − accepted)
    # did not), and the summary counts the tokens the outputs hold.
    llm = make_llm(root, model=None, nextn=3)
    prompts = ["12+7=", "day after 2024-02-28:", "json name=Ann age=31:", "count 3 to 7:"]
    stop = SamplingParams(temperature=0.0, max_tokens=32, stop=["\n"])
    outputs = llm.generate(prompts, stop, use_tqdm=True)
    assert all(o.finish_reason.value == "stop" for o in outputs)
    assert sum(o.metrics.num_accepted_draft_tokens for o in outputs) > 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    length = float(summary.split("mean acceptance length ")[1].split()[0])
    assert 1.0 <= length <= 4.0
    assert f" {sum(len(o.token_ids) for o in outputs)} generated tokens in " in summary
