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
from itertools import accumulate

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
from deepinfer_sampling.speculative import verify_rejection

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
        if len(confidence_temperatures) not in (1, nextn):
            raise ValueError(f"{len(confidence_temperatures)} confidence temperatures for {nextn} draft slots")
        self.confidence_temperatures = confidence_temperatures * (nextn if len(confidence_temperatures) == 1 else 1)
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
        num_drafts = [r.num_drafts for r in requests]
        slots = self._to_device([r.request.slot for r in requests])
        shift = self.rejected[slots] * self._to_device([int(r.placeholder) for r in requests])
        first = self._to_device([r.first_position for r in requests]) - shift  # true P0 per request
        row_request = self._to_device([i for i, d in enumerate(num_drafts) for _ in range(d + 1)])
        row_positions = first[row_request] + self._to_device([j for d in num_drafts for j in range(d + 1)])
        batch = replace(batch, positions=row_positions)
        target, invalid = self.sampler.processed_logprobs(logits, batch, bitmask)

        draft_index = [i for r in requests for i in (*range(r.draft_index, r.draft_index + r.num_drafts), -1)]
        fresh_row = target.new_zeros(1, target.shape[1])  # ignored by the verifier
        pieces: list[torch.Tensor] = []
        for spec in requests:
            probs, d = spec.request.draft_probs, spec.num_drafts
            if d:
                if probs is None or probs.shape[0] < d:
                    raise RuntimeError(f"{d} drafts scheduled for a request the drafter proposed no drafts for")
                pieces.append(probs[:d])
            pieces.append(fresh_row)
        draft_probs = torch.cat(pieces)
        index = self._to_device(draft_index)
        draft_ids = torch.where(index >= 0, self.buffers.input_ids[index.clamp(min=0)], -1)
        forced = batch.forced_token_ids if batch.has_forced_tokens else None
        verified = verify_rejection(
            target,
            draft_ids,
            draft_probs,
            self._to_device(num_drafts),
            batch.seeds,
            row_positions,
            forced_token_ids=forced,
        )
        tokens = torch.where(invalid, -1, verified.output_token_ids)
        accepted = verified.num_accepted_draft_tokens
        history = self.buffers.history
        row_slots = slots[row_request]
        history[row_slots, row_positions] = torch.where(tokens >= 0, tokens, history[row_slots, row_positions])
        self.rejected[slots] = self._to_device(num_drafts) - accepted
        token_logprobs = target.gather(1, tokens.clamp(min=0)[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
        top_ids, top_values = top_logprobs(target, min(batch.max_top_logprobs, target.shape[1]))
        if any(r.request.params.is_greedy for r in requests):
            token_logprobs, top_ids, top_values = model_logprobs_for_greedy_rows(
                logits, batch.temperature == 0, tokens, token_logprobs, top_ids, top_values
            )
        first_rows = [0, *accumulate(d + 1 for d in num_drafts)][:-1]
        golden = verified.output_token_ids[self._to_device(first_rows) + accepted]
        drafts, confidences = self._propose(requests, slots, first - 1 + accepted, golden)
        return copy_to_host(tokens, token_logprobs, top_ids, top_values, accepted, drafts, confidences)

    def _propose(
        self,
        requests: Sequence[SpecRequest],
        slots: torch.Tensor,
        last_accepted: torch.Tensor,
        golden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `nextn` tokens per request and write them into the history after the emitted token.

        Args:
            requests: the step's sampling requests.
            slots: [S] int64 their state slots.
            last_accepted: [S] int64 p*, position of each request's last accepted token.
            golden: [S] int64 the token each request emitted last (at p* + 1).

        Returns:
            int64 [S, nextn] drafts and float32 [S, nextn] the confidence head's conditional acceptance probability
            of each.
        """
        b = self.nextn
        drafts = torch.empty((len(requests), b), dtype=torch.int64, device=self.device)
        confidences = torch.empty((len(requests), b), dtype=torch.float32, device=self.device)
        positions = last_accepted[:, None] + 1 + self._slots[None, :]
        input_ids = torch.where(self._slots[None, :] == 0, golden[:, None], self.noise_token_id)
        n = len(requests)
        batch_rows = self._to_device([r.batch_index for r in requests])
        max_context = max(r.first_position + r.num_drafts + b for r in requests)
        hidden = None
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, batch_rows, slots, max_context)
        if hidden is None:
            draft_batch = self.buffers.draft_batch(input_ids, positions, batch_rows, slots, max_context)
            hidden = self.model.draft_forward(draft_batch, self.state)
        hidden = hidden.reshape(n, b, -1)
        rows = [SamplingRow(params=r.request.params, seed=r.request.seed, position=0) for r in requests]
        sampling = SamplingBatch.build(rows, self.sampler.vocab_size, self.device)
        previous = golden
        probs = []
        for k in range(b):
            temperature = torch.full((n,), self.confidence_temperatures[k], dtype=torch.float32, device=self.device)
            logits, confidence = self.model.draft_heads(hidden[:, k], previous, temperature)
            confidences[:, k] = confidence
            logprobs, _ = self.sampler.processed_logprobs(logits, sampling)
            row_probs = logprobs.exp()
            bits = random_bits(sampling.seeds, last_accepted + 2 + k, RandomStream.DRAFT, 1)[:, 0]
            sampled = inverse_cdf_sample(row_probs, bits)
            # Nothing to sample (every draft logit masked): propose the argmax with probability 1, which is then the
            # distribution the draft came from, so verification stays exact.
            empty = sampled < 0
            previous = torch.where(empty, logits.argmax(dim=-1), sampled)
            one_hot = torch.zeros_like(row_probs).scatter_(1, previous[:, None], 1.0)
            row_probs = torch.where(empty[:, None], one_hot, row_probs)
            drafts[:, k] = previous
            probs.append(row_probs)
        # Placeholder inputs of the next step read the drafts from the history (asynchronous scheduling).
        self.buffers.history[slots[:, None], positions + 1] = drafts
        stacked = torch.stack(probs, dim=1)
        for j, r in enumerate(requests):
            r.request.draft_probs = stacked[j]
        return drafts, confidences

    def close(self) -> None:
        """Release the draft graphs."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 [len(values)] on the device, copied from pinned memory without blocking on CUDA."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
