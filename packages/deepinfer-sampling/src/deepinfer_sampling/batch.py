"""`SamplingBatch`: the per-step tensors the sampler reads, built once per step from per-row inputs.

A *row* is one logits row to sample from: one per request in a plain step, several per request when drafts are
verified. The engine describes each row with a `SamplingRow` (the request's `SamplingParams`, its request seed from
`seeds.request_seed`, the row's position key and the request's generation state) and calls `SamplingBatch.build`,
which validates the inputs on the host, lays them out as tensors in pinned memory and copies them to the device
without blocking. Per-row parameters are encoded the way the sampler consumes them (fixed-point top-p threshold,
log min-p, vocabulary-clamped top-k, -1 sentinels), so no per-step work remains on the host after this.

Penalty state is only materialised for the rows that use a penalty: `penalty_rows` indexes them and
`output_token_counts` / `prompt_token_mask` hold one [vocab] row each, filled on the device by scatter-add.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_sampling.params import SamplingParams
from deepinfer_sampling.seeds import seed_to_int64

TOP_P_SCALE = 2**31  # fixed-point unit of probability mass (see sampler.py)


@dataclass(frozen=True)
class SamplingRow:
    """Host-side description of one sampling row.

    Attributes:
        params: the request's sampling parameters.
        seed: the request seed in [0, 2^64) (`seeds.request_seed`).
        position: position key of the row (the absolute index of the token it generates), >= 0.
        num_generated_tokens: output tokens the request already has before this row's token.
        output_token_ids: those output tokens (used only when the request has a penalty).
        prompt_token_ids: the prompt tokens (used only when the request has a repetition penalty).
    """

    params: SamplingParams
    seed: int
    position: int
    num_generated_tokens: int = 0
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()


def _to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _check_token_ids(name: str, row: int, ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"rows[{row}].{name} must be in [0, {vocab_size}), got {bad[:8]}")


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step sampling tensors, one entry per row (B rows, P of them with penalties), on one device.

    Attributes:
        temperature: float32 [B]; 0.0 marks a greedy row.
        top_k: int32 [B]; number of tokens kept, `vocab_size` when disabled.
        top_p_threshold: int64 [B]; floor(top_p · 2^31): a token is kept while the fixed-point mass ranked strictly
            above it is <= this; 2^31 when disabled.
        log_min_p: float32 [B]; log(min_p), -inf when disabled.
        seeds: int64 [B]; request seeds (uint64 bits).
        positions: int64 [B]; position keys.
        suppressed_eos_ids: int64 [B]; EOS id masked on this row (first_n_token_no_eos), -1 for none.
        forced_token_ids: int64 [B]; golden token emitted on this row, -1 for none.
        penalty_rows: int64 [P]; rows with a penalty.
        repetition_penalties, presence_penalties, frequency_penalties: float32 [P].
        output_token_counts: int32 [P, vocab_size]; occurrences of each token in the row's output so far.
        prompt_token_mask: bool [P, vocab_size] or None (None when no row has a repetition penalty).
        vocab_size: number of logit columns.
        num_top_logprobs: per-row number of top logprobs requested (host).
        max_top_logprobs: max of `num_top_logprobs` (host).
        all_greedy: every row is greedy (host).
        any_greedy: some row is greedy (host).
        needs_truncation: some non-greedy row uses top-k, top-p or min-p (host).
        has_eos_suppression, has_forced_tokens: some row uses that feature (host).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_threshold: torch.Tensor
    log_min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    suppressed_eos_ids: torch.Tensor
    forced_token_ids: torch.Tensor
    penalty_rows: torch.Tensor
    repetition_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    output_token_counts: torch.Tensor
    prompt_token_mask: torch.Tensor | None
    vocab_size: int
    num_top_logprobs: tuple[int, ...]
    max_top_logprobs: int
    all_greedy: bool
    any_greedy: bool
    needs_truncation: bool
    has_eos_suppression: bool
    has_forced_tokens: bool

    @property
    def num_rows(self) -> int:
        """B, the number of rows."""
        return len(self.num_top_logprobs)

    @property
    def device(self) -> torch.device:
        """The device every tensor lives on."""
        return self.temperature.device

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Builds the step's tensors from per-row inputs.

        Args:
            rows: one `SamplingRow` per logits row, in logits-row order.
            vocab_size: number of logit columns.
            device: where the tensors go (copies are non-blocking from pinned memory on CUDA).

        Returns:
            The batch.
        """
        device = torch.device(device)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[int] = []
        log_min_ps: list[float] = []
        seeds: list[int] = []
        positions: list[int] = []
        eos: list[int] = []
        forced: list[int] = []
        num_top: list[int] = []
        pen_rows: list[int] = []
        pen_values: list[list[float]] = [[], [], []]
        count_index: list[int] = []
        prompt_index: list[int] = []
        any_repetition = False
        for i, row in enumerate(rows):
            p = row.params
            if row.position < 0 or row.num_generated_tokens < 0:
                raise ValueError(
                    f"rows[{i}].position and num_generated_tokens must be >= 0, "
                    f"got {row.position} and {row.num_generated_tokens}"
                )
            temps.append(p.temperature)
            top_ks.append(vocab_size if p.top_k == -1 else min(p.top_k, vocab_size))
            top_ps.append(math.floor(p.top_p * TOP_P_SCALE))
            log_min_ps.append(math.log(p.min_p) if p.min_p > 0 else -math.inf)
            seeds.append(seed_to_int64(row.seed))
            positions.append(row.position)
            suppress = row.num_generated_tokens < p.first_n_token_no_eos
            if suppress and p.eos_id >= vocab_size:
                raise ValueError(f"rows[{i}].params.eos_id must be < vocab_size={vocab_size}, got {p.eos_id}")
            eos.append(p.eos_id if suppress else -1)
            golden = p.golden_token_ids
            force = golden is not None and row.num_generated_tokens < len(golden)
            forced.append(golden[row.num_generated_tokens] if golden is not None and force else -1)
            if force and forced[-1] >= vocab_size:
                raise ValueError(f"rows[{i}] golden token {forced[-1]} must be < vocab_size={vocab_size}")
            num_top.append(p.top_logprobs)
            if p.has_penalties:
                slot = len(pen_rows)
                pen_rows.append(i)
                pen_values[0].append(p.repetition_penalty)
                pen_values[1].append(p.presence_penalty)
                pen_values[2].append(p.frequency_penalty)
                _check_token_ids("output_token_ids", i, row.output_token_ids, vocab_size)
                count_index.extend(slot * vocab_size + t for t in row.output_token_ids)
                if p.repetition_penalty != 1.0:
                    any_repetition = True
                    _check_token_ids("prompt_token_ids", i, row.prompt_token_ids, vocab_size)
                    prompt_index.extend(slot * vocab_size + t for t in row.prompt_token_ids)

        num_pen = len(pen_rows)
        counts = torch.zeros(num_pen * vocab_size, dtype=torch.int32, device=device)
        if count_index:
            index = _to_device(count_index, torch.int64, device)
            counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
        prompt_mask = None
        if any_repetition:
            prompt_mask = torch.zeros(num_pen * vocab_size, dtype=torch.bool, device=device)
            if prompt_index:
                prompt_mask[_to_device(prompt_index, torch.int64, device)] = True
            prompt_mask = prompt_mask.view(num_pen, vocab_size)
        greedy = [t == 0.0 for t in temps]
        return cls(
            temperature=_to_device(temps, torch.float32, device),
            top_k=_to_device(top_ks, torch.int32, device),
            top_p_threshold=_to_device(top_ps, torch.int64, device),
            log_min_p=_to_device(log_min_ps, torch.float32, device),
            seeds=_to_device(seeds, torch.int64, device),
            positions=_to_device(positions, torch.int64, device),
            suppressed_eos_ids=_to_device(eos, torch.int64, device),
            forced_token_ids=_to_device(forced, torch.int64, device),
            penalty_rows=_to_device(pen_rows, torch.int64, device),
            repetition_penalties=_to_device(pen_values[0], torch.float32, device),
            presence_penalties=_to_device(pen_values[1], torch.float32, device),
            frequency_penalties=_to_device(pen_values[2], torch.float32, device),
            output_token_counts=counts.view(num_pen, vocab_size),
            prompt_token_mask=prompt_mask,
            vocab_size=vocab_size,
            num_top_logprobs=tuple(num_top),
            max_top_logprobs=max(num_top, default=0),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_truncation=any(
                not g and (k < vocab_size or tp < TOP_P_SCALE or lm > -math.inf)
                for g, k, tp, lm in zip(greedy, top_ks, top_ps, log_min_ps, strict=True)
            ),
            has_eos_suppression=any(e >= 0 for e in eos),
            has_forced_tokens=any(f >= 0 for f in forced),
        )
