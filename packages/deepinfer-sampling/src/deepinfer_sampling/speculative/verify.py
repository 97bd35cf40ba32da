"""Speculative verification: which draft tokens a decode step keeps and which token it adds
(docs/design/speculative.md, "Verification").

Row layout. A decode step verifies ``d_b`` drafts of request ``b`` (``0 <= d_b <= nextn``, chosen by ``policy.py``)
with ``d_b + 1`` consecutive sampling rows; rows of all requests are packed back to back (R = Σ (d_b + 1))::

    request 0 (d=2)          request 1 (d=0)   request 2 (d=1)
    [ v0  v1  f ]            [ f ]             [ v0  f ]
      │   │   └ fresh row: target distribution after the last draft
      │   └──── verify row 1: scores draft x₂ (target given x₁)
      └──────── verify row 0: scores draft x₁ (target given the committed prefix)

Glossary:
    accepted token: a draft ``x`` kept by its verify row: accepted with probability ``min(1, q(x) / p(x))`` (q = the
        row's processed target distribution, p = the draft distribution that proposed ``x``); under greedy sampling,
        iff ``x`` is the target argmax. A request keeps the longest prefix of accepted drafts (``a_b`` of them).
    recovered token: the token emitted by the first rejected verify row, sampled from the residual
        ``normalize(max(q − α·p, 0))``; this correction makes the emitted token exactly q-distributed. α = e^−δ with
        δ = ``draft_prob_penalty`` (5e-5 in the reference) keeps the residual non-empty when p = q; the emitted
        distribution then deviates from q by at most a relative ≈ δ. If the residual has no mass the row's target
        argmax is emitted.
    bonus token: the token emitted by the fresh row when every verified draft was accepted, sampled from q.

Each request emits ``a_b + 1`` tokens: its accepted drafts then the recovered or bonus token. Every random draw is
keyed by (request seed, row position, stream) through ``seeds.py`` — accept uniforms use ``RandomStream.ACCEPT``,
recovered tokens ``RECOVERED``, bonus tokens ``SAMPLE`` (the plain sampler's stream: a request verifying no drafts
gets exactly the token the plain sampler would give it) — so results never depend on the batch's composition. q is the
sampler's processed distribution (``Sampler.processed_logprobs``: masks incl. the grammar bitmask, temperature,
top-k/top-p), so a grammar-invalid draft has q(x) = 0 and is always rejected, and greedy rows (one-hot q) reduce to
argmax matching; ``verify_greedy`` is that reduction for steps whose rows are all greedy (no draft distributions, no
draws, the same results). Golden (forced) rows accept a draft iff it equals the forced id and emit the forced id.
Everything is tensor code with shapes known from the inputs: no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer_sampling.inverse_cdf import inverse_cdf_sample
from deepinfer_sampling.seeds import RandomStream, random_bits, uniforms

DRAFT_PROB_PENALTY = 5e-5


@dataclass(frozen=True)
class RowLayout:
    """Where each packed row belongs (all int64, on the device).

    Attributes:
        row_to_request: [R], request index of every row.
        row_offset: [R], index of the row within its request (0 … d_b).
        is_fresh: bool [R], True on each request's last row.
    """

    row_to_request: torch.Tensor
    row_offset: torch.Tensor
    is_fresh: torch.Tensor


@dataclass(frozen=True)
class VerificationOutput:
    """Result of verifying one decode step (B requests, R rows).

    Attributes:
        output_token_ids: int64 [R]; row ``j`` of request ``b`` holds its emitted token for ``j <= a_b`` (the draft
            for ``j < a_b``, the recovered or bonus token at ``j = a_b``) and −1 after.
        num_accepted_draft_tokens: int64 [B]; ``a_b``.
        accept_probs: float32 [R]; probability that the row's draft would be accepted, ``1 − Σ residual``
            (1 on fresh rows), for confidence statistics.
    """

    output_token_ids: torch.Tensor
    num_accepted_draft_tokens: torch.Tensor
    accept_probs: torch.Tensor


def row_layout(num_draft_tokens: torch.Tensor, num_rows: int) -> RowLayout:
    """Expand per-request draft counts to per-row indices without a host sync.

    Args:
        num_draft_tokens: int [B], drafts verified per request (d_b >= 0).
        num_rows: R = Σ (d_b + 1), known on the host from the logits shape.

    Returns:
        The ``RowLayout``.
    """
    rows_per_request = num_draft_tokens.to(torch.int64) + 1
    requests = torch.arange(rows_per_request.shape[0], device=rows_per_request.device)
    row_to_request = torch.repeat_interleave(requests, rows_per_request, output_size=num_rows)
    first_row = torch.cumsum(rows_per_request, dim=0) - rows_per_request
    row_offset = torch.arange(num_rows, device=rows_per_request.device) - first_row[row_to_request]
    is_fresh = row_offset == num_draft_tokens.to(torch.int64)[row_to_request]
    return RowLayout(row_to_request, row_offset, is_fresh)


def _check_rows(name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(tensor.shape) != shape or tensor.device != device:
        raise ValueError(
            f"{name} must have shape {list(shape)} on {device}, got {list(tensor.shape)} on {tensor.device}"
        )


def _emit(
    accepted: torch.Tensor, candidates: torch.Tensor, layout: RowLayout, num_requests: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the prefix rule: (output_token_ids [R], num_accepted [B])."""
    num_rows = accepted.shape[0]
    stop_offset = torch.where(accepted, num_rows, layout.row_offset)  # fresh rows are never accepted
    num_accepted = torch.full((num_requests,), num_rows, dtype=torch.int64, device=accepted.device)
    num_accepted = num_accepted.scatter_reduce(0, layout.row_to_request, stop_offset, reduce="amin")
    emitted = layout.row_offset <= num_accepted[layout.row_to_request]
    return torch.where(emitted, candidates, -1), num_accepted


def verify_rejection(
    target_logprobs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    forced_token_ids: torch.Tensor | None = None,
    draft_prob_penalty: float = DRAFT_PROB_PENALTY,
    layout: RowLayout | None = None,
) -> VerificationOutput:
    """Lossless speculative (rejection) sampling over packed rows; see the module docstring.

    Args:
        target_logprobs: float32 [R, V], processed target log-probs ℓ' of every row (−inf outside the kept set),
            from ``Sampler.processed_logprobs`` on the same rows.
        draft_token_ids: int64 [R], the draft each verify row scores; ignored on fresh rows; −1 = no draft (the row
            rejects and samples its token from q).
        draft_probs: float32 [R, V], the draft distribution each verify row's draft was sampled from (rows sum to 1;
            ignored on fresh rows).
        num_draft_tokens: int [B], drafts verified per request (R = Σ (d_b + 1)).
        seeds: int64 [R], request seed of every row (``SamplingBatch.seeds``).
        positions: int64 [R], position key of every row: the absolute index of the token the row generates
            (``SamplingBatch.positions``).
        forced_token_ids: int64 [R] golden tokens (−1 = not forced), or None.
        draft_prob_penalty: δ >= 0; the residual subtracts e^−δ·p instead of p.
        layout: ``row_layout(num_draft_tokens, R)`` when the caller has it already (e.g. uploaded from the host).

    Returns:
        The step's ``VerificationOutput``.
    """
    num_rows, vocab_size = target_logprobs.shape
    device = target_logprobs.device
    for name, tensor in (("draft_token_ids", draft_token_ids), ("seeds", seeds), ("positions", positions)):
        _check_rows(name, tensor, (num_rows,), device)
    _check_rows("draft_probs", draft_probs, (num_rows, vocab_size), device)
    if not draft_prob_penalty >= 0:
        raise ValueError(f"draft_prob_penalty={draft_prob_penalty} must be >= 0")
    layout = layout if layout is not None else row_layout(num_draft_tokens, num_rows)
    verify_row = ~layout.is_fresh & (draft_token_ids >= 0)
    safe_draft = draft_token_ids.clamp(min=0)[:, None]

    target_probs = torch.exp(target_logprobs)
    target_of_draft = target_probs.gather(1, safe_draft)[:, 0]
    draft_of_draft = draft_probs.gather(1, safe_draft)[:, 0]
    u = uniforms(seeds, positions, RandomStream.ACCEPT, 1)[:, 0]
    # u < q/p written without a division: a zero-probability target token is never accepted.
    accepted = verify_row & (u * draft_of_draft < target_of_draft)

    residual = (target_probs - math.exp(-draft_prob_penalty) * draft_probs).clamp(min=0.0)
    residual_mass = residual.sum(dim=-1)
    # Scale each residual so its largest weight is 1: fixed-point sampling then keeps full relative precision.
    scale = residual.amax(dim=-1, keepdim=True)
    residual = residual / torch.where(scale > 0, scale, 1.0)
    # A verify row without a draft (id −1) has nothing to correct for: it samples q like a fresh row.
    weights = torch.where((layout.is_fresh | (draft_token_ids < 0))[:, None], target_probs, residual)
    stream = torch.where(layout.is_fresh, int(RandomStream.SAMPLE), int(RandomStream.RECOVERED))
    sampled = inverse_cdf_sample(weights, random_bits(seeds, positions, stream, 1)[:, 0])
    candidates = torch.where(sampled >= 0, sampled, target_logprobs.argmax(dim=-1))
    candidates = torch.where(accepted, draft_token_ids, candidates)
    accept_probs = torch.where(layout.is_fresh, 1.0, (1.0 - residual_mass).clamp(min=0.0))
    return _finish(
        accepted,
        candidates,
        accept_probs,
        verify_row,
        draft_token_ids,
        forced_token_ids,
        layout,
        num_draft_tokens.shape[0],
    )


def verify_greedy(
    target_logprobs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    *,
    forced_token_ids: torch.Tensor | None = None,
    layout: RowLayout | None = None,
) -> VerificationOutput:
    """``verify_rejection`` for rows whose processed target distribution q is one-hot (greedy rows; rows with nothing
    to sample are all −inf): the same output tokens and accepted counts whatever the draft distributions, without
    them and without random draws (docs/design/speculative.md, "Greedy steps").

    With q one-hot at t, a draft x is accepted iff q(x) = 1, i.e. x = t (``u·p(x) < q(x)`` holds for every uniform
    u < 1 and p(x) <= 1 exactly then). Every other row emits t: the residual ``max(q − α·p, 0)`` of a rejected draft
    is 0 except at t, and a row whose weights are all 0 takes q's argmax, t (or id 0 on an all −inf row).

    Args:
        target_logprobs: float32 [R, V], one-hot (0 at one id, −inf elsewhere) or all −inf rows.
        draft_token_ids: int64 [R], as for ``verify_rejection``.
        num_draft_tokens: int [B], drafts verified per request (R = Σ (d_b + 1)).
        forced_token_ids: int64 [R] golden tokens (−1 = not forced), or None.
        layout: ``row_layout(num_draft_tokens, R)`` when the caller has it already.

    Returns:
        The step's ``VerificationOutput``; its ``accept_probs`` are q(x), the exact acceptance probabilities
        (``verify_rejection``'s ``1 − Σ residual`` differs from them by the α penalty).
    """
    num_rows, _ = target_logprobs.shape
    _check_rows("draft_token_ids", draft_token_ids, (num_rows,), target_logprobs.device)
    layout = layout if layout is not None else row_layout(num_draft_tokens, num_rows)
    verify_row = ~layout.is_fresh & (draft_token_ids >= 0)
    target_of_draft = torch.exp(target_logprobs.gather(1, draft_token_ids.clamp(min=0)[:, None])[:, 0])
    accepted = verify_row & (target_of_draft == 1.0)
    accept_probs = torch.where(verify_row, target_of_draft, layout.is_fresh.to(torch.float32))
    candidates = target_logprobs.argmax(dim=-1)
    return _finish(
        accepted,
        candidates,
        accept_probs,
        verify_row,
        draft_token_ids,
        forced_token_ids,
        layout,
        num_draft_tokens.shape[0],
    )


def _finish(
    accepted: torch.Tensor,
    candidates: torch.Tensor,
    accept_probs: torch.Tensor,
    verify_row: torch.Tensor,
    draft_token_ids: torch.Tensor,
    forced_token_ids: torch.Tensor | None,
    layout: RowLayout,
    num_requests: int,
) -> VerificationOutput:
    """Golden rows (accept a draft iff it equals the forced id, emit the forced id), then the prefix rule."""
    if forced_token_ids is not None:
        _check_rows("forced_token_ids", forced_token_ids, tuple(accepted.shape), accepted.device)
        forced = forced_token_ids >= 0
        accepted = torch.where(forced, verify_row & (draft_token_ids == forced_token_ids), accepted)
        candidates = torch.where(forced, forced_token_ids, candidates)
    output, num_accepted = _emit(accepted, candidates, layout, num_requests)
    return VerificationOutput(output, num_accepted, accept_probs)
