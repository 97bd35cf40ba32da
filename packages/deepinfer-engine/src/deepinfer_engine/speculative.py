"""Speculative decoding in the runner: verify a step's draft tokens, then draft the next ones with DSpark.

With `nextn` > 0 (`EngineArgs.nextn`) every sampling step of the runner goes through `Speculator.sample` instead of
the plain sampler. Per sampling request the step has `d + 1` logits rows (`d` = its verified drafts, 0 … nextn):

    row j = 0 … d at position P0 + j (P0 = the first position the step samples, the previous golden token sits at
    P0 − 1): row j < d scores draft x_{j+1}, row d is the fresh row.

1. Verification (docs/design/speculative.md, "Verification"): the rows' processed target distributions
   (`Sampler.processed_logprobs`: masks, temperature, top-k/top-p) are checked against the drafts with
   `deepinfer_sampling.speculative.verify_rejection`, which is exact rejection sampling keyed by (request seed,
   position): lossless for sampled requests, argmax matching for greedy ones (their q is one-hot). A request emits its
   `a` accepted drafts and one recovered/bonus token; the emitted tokens go into the runner's token history. Rejected
   positions need no cache action: the scheduler rolls back positionally and later steps overwrite those rows.
2. Drafting (docs/design/model.md, "Draft forward", "Draft heads"): with `p* = P0 − 1 + a` (the last accepted position)
   and `g` the emitted token, each drafting request's block `[g, N, …, N]` at positions `p* + 1 … p* + nextn` runs
   through the DSpark blocks in one forward (the main forward already wrote the context keys of every verify row); then
   slot k's draft logits get the Markov bias of the previous token and the draft token is sampled from the processed
   draft distribution with the request's own parameters, keyed by (seed, p* + 2 + k, `RandomStream.DRAFT`). Its
   probability row is kept on the device (`RunnerRequest.draft_probs`) for the next step's rejection test.

Greedy steps (docs/design/speculative.md, "Greedy steps"), decided on the host from the requests' parameters: when
every row is greedy, verification is `verify_greedy` (argmax matching, no draft distributions, no draws), and when
`Sampler.processed_is_raw_argmax` holds for the draft rows, each draft is the argmax of its draft logits with a
one-hot probability row. Both give bit for bit what the general path gives.

Requests whose sampling needs their earlier tokens on the host (`RunnerRequest.needs_host_history`) draft and
verify like any other (docs/design/speculative.md, "Drafts with grammars, penalties and golden tokens"); the runner
builds their verify rows so that row j sees drafts 1 … j as if they were committed: the grammar mask of row j is the
matcher's state after accepting them (rolled back afterwards), the penalty state of row j counts them, and a golden
token forces row j's token (a draft is accepted iff it equals it). The drafter itself proposes unconstrained drafts: a
draft the grammar forbids has target probability 0 on its row and is always rejected. Everything up to the copies to
the host runs without a host sync. Verify steps in which every request checks the same
number of drafts replay CUDA graphs like decode steps, and so does the draft forward (`deepinfer_engine.cuda_graphs`).

Asynchronous scheduling (outputs.py, "Placeholders"). A request whose sampling step N is in flight is scheduled for
step N + 1 with placeholder inputs (N's emitted token, then its `nextn` drafts) at optimistic positions that assume
every draft of N is accepted. The drafter writes its drafts into the token history after the emitted token, and the
verify step takes the drafts it checks from the step's device input ids. The per-slot `rejected` counts (drafts N
rejected) shift the placeholder rows back on the device: inputs and context lengths in `StepBuffers.upload`, random
keys, history writes and drafter positions here; the runner shifts its host records once N's results are known
(`RunnerRequest.num_rejected`). Results therefore equal those of synchronous scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import torch

from deepinfer_engine.cuda_graphs import DraftGraphs
from deepinfer_engine.input_batch import StepBuffers
from deepinfer_engine.runner_state import RunnerRequest, SampledStep, copy_to_host
from deepinfer_engine.sampling_rows import model_logprobs_for_greedy_rows
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.state import ModelState
from deepinfer_sampling import LOGPROB_FLOOR, Sampler, SamplingBatch, SamplingRow
from deepinfer_sampling.inverse_cdf import inverse_cdf_sample
from deepinfer_sampling.logprobs import top_logprobs
from deepinfer_sampling.seeds import RandomStream, random_bits
from deepinfer_sampling.speculative import RowLayout, verify_greedy, verify_rejection

__all__ = ["SpecRequest", "Speculator"]


@dataclass(frozen=True)
class SpecRequest:
    """One sampling request of a step, as the speculator sees it.

    Attributes:
        request: the runner's record (its `draft_probs` are read and replaced).
        batch_index: the request's index in the step (its block-table row).
        first_position: P0, the position its first logits row samples; optimistic when `placeholder`.
        num_drafts: the `d` draft tokens among its inputs (its rows: d + 1).
        draft_index: index of its first draft token in the step's input tokens.
        placeholder: its inputs are placeholders (asynchronous scheduling): its positions are shifted back on the
            device by the drafts the previous step rejected.
    """

    request: RunnerRequest
    batch_index: int
    first_position: int
    num_drafts: int
    draft_index: int
    placeholder: bool


@dataclass(frozen=True)
class _StepRows:
    """A step's host integers on the device (int64 views of one upload): per request [S] and per logits row [R].

    Attributes:
        slots: state slot of each request.
        first_positions: P0 of each request (optimistic for placeholder requests).
        num_drafts: drafts each request verifies.
        first_rows: index of each request's first row.
        batch_rows: each request's row in the step's block table.
        row_slots: state slot of each row's request.
        row_positions: position of each row (optimistic for placeholder requests).
        row_placeholder: 1 on the rows of placeholder requests, else 0.
        draft_index: index in the step's input tokens of the draft each row scores (any input token on fresh rows).
        row_request, row_offset, row_fresh: the rows' `RowLayout` (request index, index within the request, 1 on
            each request's fresh row).
    """

    slots: torch.Tensor
    first_positions: torch.Tensor
    num_drafts: torch.Tensor
    first_rows: torch.Tensor
    batch_rows: torch.Tensor
    row_slots: torch.Tensor
    row_positions: torch.Tensor
    row_placeholder: torch.Tensor
    draft_index: torch.Tensor
    row_request: torch.Tensor
    row_offset: torch.Tensor
    row_fresh: torch.Tensor

    def layout(self) -> RowLayout:
        """The rows' layout for the verifiers."""
        return RowLayout(self.row_request, self.row_offset, self.row_fresh.bool())


class Speculator:
    """Verification and DSpark drafting for one runner (see the module docstring).

    Args:
        model: the target model; must have DSpark blocks.
        state: its cache pools.
        buffers: the runner's step buffers (block table of the step, input tokens, token history); the speculator
            gives them its per-slot rejected-draft counts (`StepBuffers.rejected_drafts`).
        sampler: the runner's sampler (processed distributions).
        nextn: drafts proposed per request per step, >= 1.
        num_state_slots: state slots of the cache.
        graphs: captured draft forwards (CUDA), or None to run the drafter eagerly.
        confidence_temperatures: the confidence head's temperature, one for every draft slot or one per slot.

    Raises:
        ValueError: the model has no DSpark blocks, or `nextn` < 1.
    """

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        buffers: StepBuffers,
        sampler: Sampler,
        nextn: int,
        num_state_slots: int,
        graphs: DraftGraphs | None = None,
        confidence_temperatures: tuple[float, ...] = (1.0,),
    ) -> None:
        if not model.config.text.num_nextn_predict_layers:
            raise ValueError(f"nextn={nextn} needs DSpark draft blocks, but the model has none")
        if nextn < 1:
            raise ValueError(f"nextn must be >= 1 for a Speculator, got {nextn}")
        self.model = model
        self.state = state
        self.buffers = buffers
        self.sampler = sampler
        self.nextn = nextn
        self.graphs = graphs
        self.device = buffers.device
        self.noise_token_id = model.config.text.dspark_noise_token_id
        self._slots = torch.arange(nextn, dtype=torch.int64, device=self.device)
        self._first_slot = self._slots == 0
        if len(confidence_temperatures) not in (1, nextn):
            raise ValueError(f"{len(confidence_temperatures)} confidence temperatures for {nextn} draft slots")
        per_slot = confidence_temperatures * (nextn if len(confidence_temperatures) == 1 else 1)
        self._confidence_temperatures = torch.tensor(per_slot, dtype=torch.float32).to(self.device)
        # Drafts the last sampling step of the slot's request rejected (scheduled − accepted), read by the next step.
        self.rejected = torch.zeros(num_state_slots, dtype=torch.int64, device=self.device)
        buffers.rejected_drafts = self.rejected

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None, requests: Sequence[SpecRequest]
    ) -> SampledStep:
        """Verify the step's drafts, record the emitted tokens, draft the next ones and start the copies to the host.

        Args:
            logits: [R, V] fp32 target logits, R = Σ (d + 1) rows request-major (module docstring).
            batch: the sampling batch of those rows (row j of a request at position P0 + j, optimistic for
                placeholder requests).
            bitmask: int32 [R, ceil(V / 32)] grammar bitmask, or None.
            requests: the sampling requests, in row order.

        Returns:
            The step's `SampledStep`: token_ids [R] (emitted tokens, −1 after them and on rows with nothing to
            sample), their logprobs and top logprobs per row, num_accepted [S], draft_ids [S, nextn].
        """
        rows = self._upload(requests)
        if any(r.placeholder for r in requests):
            # Placeholder rows sit at optimistic positions: shift them back by the drafts the last step rejected.
            row_positions = rows.row_positions - self.rejected[rows.row_slots] * rows.row_placeholder
            first = row_positions[rows.first_rows]  # true P0 per request
        else:
            row_positions, first = rows.row_positions, rows.first_positions
        batch = replace(batch, positions=row_positions)
        target, invalid = self.sampler.processed_logprobs(logits, batch, bitmask)
        draft_ids = self.buffers.input_ids[rows.draft_index]  # fresh rows read a token the verifiers ignore
        forced = batch.forced_token_ids if batch.has_forced_tokens else None
        draft_probs = self._draft_probs(requests, target.shape[1], stack=not batch.all_greedy)
        layout = rows.layout()
        if draft_probs is None:
            # Every target row is one-hot: argmax matching, no draft distributions, no random draws.
            verified = verify_greedy(target, draft_ids, rows.num_drafts, forced_token_ids=forced, layout=layout)
        else:
            verified = verify_rejection(
                target,
                draft_ids,
                draft_probs,
                rows.num_drafts,
                batch.seeds,
                row_positions,
                forced_token_ids=forced,
                layout=layout,
            )
        tokens = torch.where(invalid, -1, verified.output_token_ids)
        accepted = verified.num_accepted_draft_tokens
        history = self.buffers.history
        written = (rows.row_slots, row_positions)
        history[written] = torch.where(tokens >= 0, tokens, history[written])
        self.rejected[rows.slots] = rows.num_drafts - accepted
        token_logprobs = target.gather(1, tokens.clamp(min=0)[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
        top_ids, top_values = top_logprobs(target, min(batch.max_top_logprobs, target.shape[1]))
        if batch.any_greedy:
            token_logprobs, top_ids, top_values = model_logprobs_for_greedy_rows(
                logits, batch.temperature == 0, tokens, token_logprobs, top_ids, top_values
            )
        golden = verified.output_token_ids[rows.first_rows + accepted]
        drafts, confidences = self._propose(requests, rows, first + accepted, golden)
        return copy_to_host(tokens, token_logprobs, top_ids, top_values, accepted, drafts, confidences)

    def _draft_probs(self, requests: Sequence[SpecRequest], vocab_size: int, stack: bool) -> torch.Tensor | None:
        """Check that every request holds draft probability rows for the drafts it verifies; with `stack`, return
        them in row order with a zero row for each fresh row ([R, V], what `verify_rejection` reads)."""
        fresh_row = torch.zeros((1, vocab_size), dtype=torch.float32, device=self.device) if stack else None
        pieces: list[torch.Tensor] = []
        for spec in requests:
            probs, d = spec.request.draft_probs, spec.num_drafts
            if d:
                if probs is None or probs.shape[0] < d:
                    raise RuntimeError(f"{d} drafts scheduled for a request the drafter proposed no drafts for")
                pieces.append(probs[:d])
            if fresh_row is not None:
                pieces.append(fresh_row)  # ignored by the verifier
        return torch.cat(pieces) if fresh_row is not None else None

    def _propose(
        self, requests: Sequence[SpecRequest], rows: _StepRows, next_position: torch.Tensor, golden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `nextn` tokens per request and write them into the history after the emitted token.

        Args:
            requests: the step's sampling requests.
            rows: their uploaded host values.
            next_position: [S] int64 p* + 1, position of each request's last emitted token.
            golden: [S] int64 that token.

        Returns:
            int64 [S, nextn] drafts and float32 [S, nextn] the confidence head's conditional acceptance probability
            of each.
        """
        b, n = self.nextn, len(requests)
        positions = next_position[:, None] + self._slots[None, :]
        input_ids = torch.where(self._first_slot[None, :], golden[:, None], self.noise_token_id)
        max_context = max(r.first_position + r.num_drafts + b for r in requests)
        hidden = None
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, rows.batch_rows, rows.slots, max_context)
        if hidden is None:
            draft_batch = self.buffers.draft_batch(input_ids, positions, rows.batch_rows, rows.slots, max_context)
            hidden = self.model.draft_forward(draft_batch, self.state)
        # The LM head over every slot at once; only the Markov bias and the confidence wait for the previous draft.
        head_logits = self.model.draft_logits(hidden).view(n, b, -1)
        hidden = hidden.reshape(n, b, -1)
        draft_rows = [SamplingRow(params=r.request.params, seed=r.request.seed, position=0) for r in requests]
        # Greedy drafts are the argmax of the draft logits (docs/design/speculative.md, "Greedy steps").
        sampling = None
        if not self.sampler.processed_is_raw_argmax(draft_rows):
            sampling = SamplingBatch.build(draft_rows, self.sampler.vocab_size, self.device)
        previous = golden
        drafts, confidences, probs = [], [], []
        for k in range(b):
            temperature = self._confidence_temperatures[k].expand(n)
            logits, confidence = self.model.draft_heads(head_logits[:, k], hidden[:, k], previous, temperature)
            if sampling is None:
                previous = logits.argmax(dim=-1)
            else:
                previous, row_probs = self._sample_draft(logits, sampling, next_position + 1 + k)
                probs.append(row_probs)
            drafts.append(previous)
            confidences.append(confidence)
        draft_ids = torch.stack(drafts, dim=1)
        # Placeholder inputs of the next step read the drafts from the history (asynchronous scheduling).
        self.buffers.history[rows.slots[:, None], positions + 1] = draft_ids
        if probs:
            draft_probs = torch.stack(probs, dim=1)
        else:  # what the sampled path gives greedy drafts
            draft_probs = logits.new_zeros((n, b, logits.shape[1])).scatter_(2, draft_ids[:, :, None], 1.0)
        for r, row_probs in zip(requests, draft_probs.unbind(0), strict=True):
            r.request.draft_probs = row_probs
        return draft_ids, torch.stack(confidences, dim=1)

    def _sample_draft(
        self, logits: torch.Tensor, sampling: SamplingBatch, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft slot's tokens [S], sampled from the processed draft distributions keyed by (seed, `positions`,
        `RandomStream.DRAFT`), and those distributions [S, V]."""
        logprobs, _ = self.sampler.processed_logprobs(logits, sampling)
        row_probs = logprobs.exp()
        bits = random_bits(sampling.seeds, positions, RandomStream.DRAFT, 1)[:, 0]
        sampled = inverse_cdf_sample(row_probs, bits)
        # Nothing to sample (every draft logit masked): propose the argmax with probability 1, which is then the
        # distribution the draft came from, so verification stays exact.
        empty = sampled < 0
        token = torch.where(empty, logits.argmax(dim=-1), sampled)
        one_hot = torch.zeros_like(row_probs).scatter_(1, token[:, None], 1.0)
        return token, torch.where(empty[:, None], one_hot, row_probs)

    def close(self) -> None:
        """Release the draft graphs."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def _upload(self, requests: Sequence[SpecRequest]) -> _StepRows:
        """The step's host integers on the device, in one copy."""
        # Lists and values in the order of `_StepRows`' fields.
        per_request: list[list[int]] = [[], [], [], [], []]
        per_row: list[list[int]] = [[], [], [], [], [], [], []]
        for i, r in enumerate(requests):
            first_row = len(per_row[0])
            for values, value in zip(
                per_request, (r.request.slot, r.first_position, r.num_drafts, first_row, r.batch_index), strict=True
            ):
                values.append(value)
            for j in range(r.num_drafts + 1):
                fresh = j == r.num_drafts
                # Row j < d scores the input token at draft_index + j; the fresh row reads the one before the drafts.
                draft = r.draft_index - 1 if fresh else r.draft_index + j
                row = (r.request.slot, r.first_position + j, int(r.placeholder), draft, i, j, int(fresh))
                for values, value in zip(per_row, row, strict=True):
                    values.append(value)
        uploaded = self._to_device(list(chain(*per_request, *per_row)))
        sizes = [len(requests)] * len(per_request) + [len(per_row[0])] * len(per_row)
        return _StepRows(*uploaded.split(sizes))

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 [len(values)] on the device, copied from pinned memory without blocking on CUDA."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
