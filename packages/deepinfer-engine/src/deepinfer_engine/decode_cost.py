"""The decode cost curve of confidence-scheduled verification: measured at start-up, cached on disk
(docs/design/speculative.md, "Decode cost curve").

`decode_cost_curve` returns the step time (ms) for a few verified-token counts, the input of
`deepinfer_sampling.speculative.DecodeCostCurve`. The counts are 1, 2, 4, … up to the most a decode step can verify,
`max_num_seqs · (1 + nextn)`, which is included. For each count T, `ceil(T / (1 + nextn))` requests hold real drafts
(short prompts prefilled through a `ModelRunner` on a temporary cache); after one warm-up step, the decode step that
verifies T tokens (each request up to `nextn` drafts) runs `TIMED_STEPS` times and the median is kept. The timed step
is a whole runner step: forward, verification and the drafter, as the reference counts its sampling phase into the
step. Counts are measured smallest first; once `MEASURE_BUDGET_S` of measuring has passed, the larger ones are
extrapolated in proportion to the last measured one (a CPU step of thousands of tokens takes many seconds). A
count's time is then capped by that of any larger count (noise on a busy host must not make a bigger step look
cheaper).

Cache: one JSON file per measurement in `EngineConfig.decode_perf_cache_dir`, named `<key>.<uuid4 hex>.<unix
seconds>` and written through a temporary file and a rename. The key is the SHA-256 of a canonical JSON of what the
times depend on: the checkpoint directory, the device (and its name on CUDA), precision, nextn, max_num_seqs,
block_size and the token counts. The newest file of the key younger than `decode_perf_cache_ttl_s` is used; files
older than that plus two hours, and files whose names do not parse, are deleted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
import time
import uuid
from pathlib import Path

import torch

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine_args import EngineArgs, build_engine_config
from deepinfer_engine.envs import EnvSettings
from deepinfer_engine.model_runner import ModelRunner
from deepinfer_engine.outputs import ScheduledRequest, SchedulerOutput
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_sampling import SamplingParams
from deepinfer_sampling.speculative import DecodeCostCurve

__all__ = ["cost_token_counts", "decode_cost_curve", "measure_decode_cost"]

logger = logging.getLogger(__name__)

TIMED_STEPS = 3
MEASURE_BUDGET_S = 20.0  # no larger count is measured after this much measuring; those are extrapolated
PROMPT_LEN = 4
STALE_GRACE_S = 2 * 3600


def cost_token_counts(max_num_seqs: int, nextn: int) -> tuple[int, ...]:
    """The verified-token counts the curve is measured at: powers of two below the largest, then the largest."""
    largest = max_num_seqs * (1 + nextn)
    counts = [1]
    while counts[-1] * 2 < largest:
        counts.append(counts[-1] * 2)
    return tuple(counts) if counts[-1] == largest else (*counts, largest)


def decode_cost_curve(
    model: DeepseekV41ForCausalLM, args: EngineArgs, env: EnvSettings, config: EngineConfig
) -> DecodeCostCurve:
    """The engine's decode cost curve: from the disk cache, or measured and then cached (module docstring)."""
    nextn = config.scheduler.max_num_draft_tokens
    counts = cost_token_counts(config.scheduler.max_num_seqs, nextn)
    device = torch.device(config.device)
    key_fields = {
        "unit": "ms",
        "model": str(Path(config.model_dir).resolve()),
        "device": device.type if device.type != "cuda" else f"cuda:{torch.cuda.get_device_name(device)}",
        "precision": config.precision,
        "nextn": nextn,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "block_size": config.cache.block_size,
        "token_counts": list(counts),
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()
    directory = config.decode_perf_cache_dir
    cached = _read_cached(directory, key, counts, config.decode_perf_cache_ttl_s) if directory is not None else None
    if cached is not None:
        logger.info("decode cost curve from the cache in %s", directory)
        return DecodeCostCurve(counts, cached)
    start = time.perf_counter()
    times = measure_decode_cost(model, args, env, config, counts)
    logger.info(
        "decode cost curve measured in %.1f s: %s", time.perf_counter() - start, dict(zip(counts, times, strict=True))
    )
    if directory is not None:
        _write_cached(directory, key, counts, times)
    return DecodeCostCurve(counts, times)


def measure_decode_cost(
    model: DeepseekV41ForCausalLM,
    args: EngineArgs,
    env: EnvSettings,
    config: EngineConfig,
    counts: tuple[int, ...],
) -> tuple[float, ...]:
    """Median ms of a decode step verifying each of `counts` tokens, through a runner on a temporary cache."""
    nextn = config.scheduler.max_num_draft_tokens
    block_size = config.cache.block_size
    max_len = PROMPT_LEN + 2 + nextn
    blocks_per_request = -(-(max_len + 1) // block_size)
    max_requests = -(-counts[-1] // (1 + nextn))
    measure_args = dataclasses.replace(
        args,
        max_model_len=max_len,
        max_num_batched_tokens=max(counts[-1], max_requests * PROMPT_LEN),
        num_cache_blocks=max_requests * blocks_per_request + 1,
        enforce_eager=True,
        async_scheduling=False,
        mtp_varlen=False,
    )
    text = model.config.text
    measure_config = build_engine_config(
        measure_args,
        env,
        model_dir=config.model_dir,
        device=config.device,
        max_position_embeddings=text.max_position_embeddings,
        cache_spec=model.cache_spec(),
        cache_budget_bytes=0,
    )
    device = torch.device(config.device)
    state = model.allocate_state(block_size, measure_config.num_blocks, measure_config.cache.num_state_slots, device)
    runner = ModelRunner(model, state, measure_config)
    prefilled: list[tuple[ScheduledRequest, int, tuple[int, ...]]] = []
    times: list[float] = []
    start = time.perf_counter()
    try:
        for count in counts:
            if times and time.perf_counter() - start > MEASURE_BUDGET_S:
                break
            needed = range(len(prefilled), -(-count // (1 + nextn)))
            prefilled += _prefill(runner, needed, nextn, blocks_per_request, text.vocab_size)
            step = _verify_step(prefilled, count, nextn, blocks_per_request)
            if not times:
                runner.wait(runner.execute(step))  # warm-up
            times.append(_median_ms(runner, step))
    finally:
        runner.close()
        del runner, state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # A step never costs less than a smaller one: keep each count's time at most that of any larger count.
    for i in range(len(times) - 2, -1, -1):
        times[i] = min(times[i], times[i + 1])
    # Counts past the time budget: proportional to the last measured one (verify steps are compute-bound there).
    measured = len(times)
    times += [times[-1] * count / counts[measured - 1] for count in counts[measured:]]
    return tuple(times)


def _prefill(
    runner: ModelRunner, indices: range, nextn: int, blocks_per_request: int, vocab_size: int
) -> list[tuple[ScheduledRequest, int, tuple[int, ...]]]:
    """Prefill the short prompts of requests `indices`; returns each one's scheduled prompt, sampled token and
    drafts."""
    if not indices:
        return []
    prefill = []
    for i in indices:
        prompt = tuple((11 * (i + p) + 3) % vocab_size for p in range(PROMPT_LEN))
        blocks = tuple(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request))
        params = SamplingParams(max_tokens=nextn + 2)
        prefill.append(ScheduledRequest.whole_prompt(f"cost-{i}", prompt, i + 1, blocks, params, i))
    output = runner.wait(runner.execute(SchedulerOutput(0, tuple(prefill), frozenset(), ())))
    drafts = output.draft_token_ids
    assert drafts is not None, "the cost curve needs a drafter (nextn > 0)"
    return [(s, output.sampled_token_ids[i][0], drafts[i]) for i, s in enumerate(prefill)]


def _verify_step(
    prefill: list[tuple[ScheduledRequest, int, tuple[int, ...]]], count: int, nextn: int, blocks_per_request: int
) -> SchedulerOutput:
    """The decode step of `count` tokens over the first prefilled requests, each verifying up to `nextn` drafts."""
    num_requests = -(-count // (1 + nextn))
    verify, left = [], count
    for i, (scheduled, token, drafts) in enumerate(prefill[:num_requests]):
        num_drafts = min(nextn, left - 1 - (num_requests - 1 - i))  # every later request keeps at least one row
        left -= 1 + num_drafts
        verify.append(
            dataclasses.replace(
                scheduled,
                is_new=False,
                input_token_ids=(token, *drafts[:num_drafts]),
                num_computed_tokens=PROMPT_LEN,
                num_draft_tokens=num_drafts,
                first_new_block_index=blocks_per_request,
                new_block_ids=(),
                new_request=None,
            )
        )
    return SchedulerOutput(1, tuple(verify), frozenset(), ())


def _median_ms(runner: ModelRunner, step: SchedulerOutput) -> float:
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        runner.wait(runner.execute(step))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _read_cached(directory: Path, key: str, counts: tuple[int, ...], ttl_s: int) -> tuple[float, ...] | None:
    """The newest fresh cached curve of `key`, or None; removes stale and malformed files on the way."""
    if not directory.is_dir():
        return None
    now = time.time()
    best: tuple[float, tuple[float, ...]] | None = None
    for path in directory.iterdir():
        parts = path.name.split(".")
        if path.name.endswith(".tmp"):
            continue
        if len(parts) != 3 or not parts[2].isdigit():
            path.unlink(missing_ok=True)
            continue
        age = now - int(parts[2])
        if age > ttl_s + STALE_GRACE_S:
            path.unlink(missing_ok=True)
            continue
        if parts[0] != key or age > ttl_s:
            continue
        try:
            data = json.loads(path.read_text())
            times = tuple(float(t) for t in data["ms"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        matches = tuple(data.get("token_counts", ())) == counts and len(times) == len(counts)
        if matches and (best is None or int(parts[2]) > best[0]):
            best = (int(parts[2]), times)
    return best[1] if best is not None else None


def _write_cached(directory: Path, key: str, counts: tuple[int, ...], times: tuple[float, ...]) -> None:
    """Write one measurement atomically (a temporary file renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{key}.{uuid.uuid4().hex}.{int(time.time())}"
    temporary = final.with_name(final.name + ".tmp")
    temporary.write_text(json.dumps({"token_counts": list(counts), "ms": list(times)}))
    temporary.replace(final)
