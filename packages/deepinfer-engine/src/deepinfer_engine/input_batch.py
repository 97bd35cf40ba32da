"""Persistent step buffers of the model runner and the on-device token history.

Each step's `ForwardBatch` is assembled from buffers allocated once at their maximum sizes, so steps never allocate
and (on CUDA) graph replays see fixed addresses:

    host (pinned, two alternating sets)        device (one set)                     ForwardBatch
    ---------------------------------------    ---------------------------------    ----------------------------
    token_ids    [T]  int64, -1 = placeholder → known_ids          ─┐
    token_slots  [T]  int64 state slot/token  → token_slots          ├─ history ──► input_ids [T]
    positions    [T]  int64                   → positions          ─┘                positions [T]
    cu_query_lens[R+1] int32                  → cu_query_lens                        cu_query_lens [R+1]
    context_lens [R]  int32                   → context_lens                         context_lens [R]
    block_table  [R, B] int32 (0 = null)      → block_table                          block_table [R, B]
    state_slots  [R]  int32                   → state_slots                          state_slots [R]
    logits_rows  [R+T] int64                  → logits_indices                       logits_indices [S (+ Q)]
    known_lens   [R]  int32                   → known_lens                           known_lens [R]

A step fills host set `step % 2` and copies it with non-blocking copies; the set it overwrites belongs to step − 2,
whose copies have completed (its results were waited for before this step was built).

The *token history* `[num_state_slots, max_model_len + 2]` int64 (device) holds, per state slot, the token at every
position of the request that owns the slot: host-known inputs are written into it at the start of each step, and
sampled tokens right after sampling. A placeholder input (asynchronous scheduling) is read from it, which is how the
token sampled by the step in flight reaches the next step without a host round trip; Engram n-gram prefixes are
gathered from it too (into the persistent `engram_prefix` [R, N_g − 1]). A slot's rows are rewritten from position 0
whenever a new request takes the slot.

Placeholder inputs (asynchronous scheduling with drafts) come at optimistic positions that assume every draft of the
step in flight is accepted. With `rejected_drafts` set (the speculator's per-slot count of drafts the last sampling
step rejected, `deepinfer_engine.speculative`) `upload` shifts placeholder tokens and their requests' context lengths
back by that count before it reads the history, on the device.

A uniform step replayed from a CUDA graph (`deepinfer_engine.cuda_graphs`) is padded to the graph's size with
placeholder requests (`pad_uniform`) before the upload, so the graph reads every row it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_model.forward_batch import ForwardBatch

__all__ = ["HostStep", "StepBuffers"]


@dataclass
class HostStep:
    """One host-side buffer set (see the module docstring)."""

    token_ids: torch.Tensor
    token_slots: torch.Tensor
    positions: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    logits_rows: torch.Tensor
    known_lens: torch.Tensor


class StepBuffers:
    """Host and device buffers of one runner.

    Args:
        max_num_tokens: most tokens in one step (the scheduler's token budget).
        max_num_requests: most requests in one step.
        max_blocks_per_request: block-table width.
        num_state_slots: state slots (history rows).
        max_positions: positions per history row.
        ngram_context: tokens before each query the model's Engram reads (N_g - 1; 0 without Engram).
        device: where the model runs.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_requests: int,
        max_blocks_per_request: int,
        num_state_slots: int,
        max_positions: int,
        ngram_context: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_requests = max_num_requests
        self.max_blocks_per_request = max_blocks_per_request
        self.ngram_context = ngram_context
        pin = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self._host = [
            HostStep(
                token_ids=host(max_num_tokens, dtype=torch.int64),
                token_slots=host(max_num_tokens, dtype=torch.int64),
                positions=host(max_num_tokens, dtype=torch.int64),
                cu_query_lens=host(max_num_requests + 1, dtype=torch.int32),
                context_lens=host(max_num_requests, dtype=torch.int32),
                block_table=host(max_num_requests, max_blocks_per_request, dtype=torch.int32),
                state_slots=host(max_num_requests, dtype=torch.int32),
                logits_rows=host(max_num_requests + max_num_tokens, dtype=torch.int64),
                known_lens=host(max_num_requests, dtype=torch.int32),
            )
            for _ in range(2)
        ]

        def dev(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.known_ids = dev(max_num_tokens, dtype=torch.int64)
        self.token_slots = dev(max_num_tokens, dtype=torch.int64)
        self.positions = dev(max_num_tokens, dtype=torch.int64)
        self.input_ids = dev(max_num_tokens, dtype=torch.int64)
        self.cu_query_lens = dev(max_num_requests + 1, dtype=torch.int32)
        self.context_lens = dev(max_num_requests, dtype=torch.int32)
        self.block_table = dev(max_num_requests, max_blocks_per_request, dtype=torch.int32)
        self.state_slots = dev(max_num_requests, dtype=torch.int32)
        self.logits_indices = dev(max_num_requests + max_num_tokens, dtype=torch.int64)
        self.known_lens = dev(max_num_requests, dtype=torch.int32)
        self.engram_prefix = dev(max_num_requests, ngram_context, dtype=torch.int64)
        self.history = dev(num_state_slots, max_positions, dtype=torch.int64)
        self._ngram_offsets = torch.arange(-ngram_context, 0, dtype=torch.int64, device=device)
        self.rejected_drafts: torch.Tensor | None = None  # [num_state_slots] int64, see the module docstring

    def host_set(self, step: int) -> HostStep:
        """The host buffers step `step` fills."""
        return self._host[step % 2]

    def upload(
        self,
        host: HostStep,
        num_tokens: int,
        num_requests: int,
        num_logits: int,
        max_query_len: int,
        max_context: int,
        has_prefill: bool = False,
    ) -> ForwardBatch:
        """Copy the filled prefix of `host` to the device, resolve input ids through the history, build the batch.

        Args:
            host: the step's filled host set.
            num_tokens: T, tokens of the step.
            num_requests: R, requests of the step.
            num_logits: logits rows the step needs (`logits_rows[:num_logits]`): S sampling rows, then Q prompt
                rows of requests that asked for prompt logprobs.
            max_query_len: longest query of the step (host int, saves a device sync in the model).
            max_context: longest context after the step (host int).
            has_prefill: some request computes a prefill chunk: the batch carries the known lengths (`known_lens`),
                which YOCO prefill truncation needs; other steps are never truncated and carry none.
        """
        t, r = num_tokens, num_requests
        copies = [
            (self.known_ids, host.token_ids, t),
            (self.token_slots, host.token_slots, t),
            (self.positions, host.positions, t),
            (self.cu_query_lens, host.cu_query_lens, r + 1),
            (self.context_lens, host.context_lens, r),
            (self.state_slots, host.state_slots, r),
            (self.logits_indices, host.logits_rows, num_logits),
            (self.known_lens, host.known_lens, r),
        ]
        for dst, src, n in copies:
            dst[:n].copy_(src[:n], non_blocking=True)
        self.block_table[:r].copy_(host.block_table[:r], non_blocking=True)
        slots, positions, known = self.token_slots[:t], self.positions[:t], self.known_ids[:t]
        if self.rejected_drafts is not None:
            shift = torch.where(known < 0, self.rejected_drafts[slots], 0)
            positions -= shift
            self.context_lens[:r] -= shift[self.cu_query_lens[:r].long()].to(torch.int32)
        current = self.history[slots, positions]
        self.history[slots, positions] = torch.where(known >= 0, known, current)
        self.input_ids[:t] = self.history[slots, positions]
        if self.ngram_context:
            context = self.context_lens[:r].long()
            q_len = (self.cu_query_lens[1 : r + 1] - self.cu_query_lens[:r]).long()
            prefix_positions = (context - q_len)[:, None] + self._ngram_offsets[None, :]
            gathered = self.history[self.state_slots[:r].long()[:, None], prefix_positions.clamp(min=0)]
            self.engram_prefix[:r] = torch.where(prefix_positions >= 0, gathered, -1)
        return self.batch(t, r, num_logits, max_query_len, max_context, has_prefill)

    def batch(
        self,
        num_tokens: int,
        num_requests: int,
        num_logits: int,
        max_query_len: int,
        max_context_len: int,
        has_prefill: bool = False,
    ) -> ForwardBatch:
        """The `ForwardBatch` over the first rows of the device buffers: every model forward of the runner (eager
        steps, CUDA-graph captures, lockstep padding forwards; drafts: `draft_batch`) reads its batch from here."""
        t, r = num_tokens, num_requests
        return ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            cu_query_lens=self.cu_query_lens[: r + 1],
            context_lens=self.context_lens[:r],
            block_table=self.block_table[:r],
            state_slots=self.state_slots[:r],
            engram_prefix_ids=self.engram_prefix[:r] if self.ngram_context else None,
            logits_indices=self.logits_indices[:num_logits],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            known_lens=self.known_lens[:r] if has_prefill else None,
        )

    def draft_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch_rows: torch.Tensor,
        state_slots: torch.Tensor,
        max_context_len: int,
    ) -> ForwardBatch:
        """The batch of one DSpark draft forward (`deepinfer_engine.speculative`): each of N requests is one
        non-causal block of B tokens, reading the block table of its row in the step just run.

        Args:
            input_ids: [N, B] int64 draft-block tokens.
            positions: [N, B] int64 their positions (consecutive per request).
            batch_rows: [N] int64 each request's row in the step's block table.
            state_slots: [N] int64 their state slots.
            max_context_len: a bound on the longest context (host int).
        """
        n, b = input_ids.shape
        return ForwardBatch(
            input_ids=input_ids.reshape(-1),
            positions=positions.reshape(-1),
            cu_query_lens=torch.arange(0, n * b + 1, b, dtype=torch.int32, device=self.device),
            context_lens=(positions[:, -1] + 1).to(torch.int32),
            block_table=self.block_table[batch_rows],
            state_slots=state_slots.to(torch.int32),
            engram_prefix_ids=None,
            logits_indices=None,
            max_query_len=b,
            max_context_len=max_context_len,
        )

    def placeholder_batch(self, size: int, max_context_len: int, query_len: int = 1) -> ForwardBatch:
        """Fill the device buffers with `size` placeholder requests of `query_len` tokens (token 0 at positions
        0 … q − 1 in the null block 0 and the never-used state slot 0, no Engram prefix) and return their batch. What
        CUDA-graph capture and the lockstep padding forward run: their writes land only in the null block and slot 0.
        """
        q, tokens = query_len, size * query_len
        self.state_slots[:size] = 0
        self.block_table[:size] = 0
        self.input_ids[:tokens] = 0
        self.positions[:tokens] = torch.arange(q, dtype=torch.int64, device=self.device).repeat(size)
        self.context_lens[:size] = q
        self.cu_query_lens[: size + 1] = torch.arange(0, tokens + 1, q, dtype=torch.int32, device=self.device)
        self.logits_indices[:tokens] = torch.arange(tokens, dtype=torch.int64, device=self.device)
        self.engram_prefix[:size] = -1
        return self.batch(tokens, size, tokens, q, max_context_len)

    def pad_uniform(self, host: HostStep, num_requests: int, query_len: int, num_logits: int, size: int) -> None:
        """Extend a filled uniform step (`query_len` tokens per request) to `size` requests with placeholders.

        A placeholder is token 0 at positions 0 … q − 1 in the null block 0 and the never-used state slot 0 (its
        writes land only there and its logits are discarded); logits rows `num_logits … size · q − 1` point at
        token 0.
        """
        r, q = num_requests, query_len
        for buffer in (host.token_ids, host.token_slots):
            buffer[r * q : size * q] = 0
        host.positions[r * q : size * q] = torch.arange(q, dtype=torch.int64).repeat(size - r)
        host.state_slots[r:size] = 0
        host.context_lens[r:size] = q
        host.block_table[r:size] = 0
        host.cu_query_lens[r + 1 : size + 1] = torch.arange(r + 1, size + 1, dtype=torch.int32) * q
        host.logits_rows[num_logits : size * q] = 0

    def record_sampled(self, slots: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Write sampled tokens into the history (device, no sync).

        Args:
            slots: [S] int64 state slot of each sampled request.
            positions: [S] int64 position each token was sampled for.
            token_ids: [S] int64 sampled tokens (-1 on invalid rows is stored as 0; such requests are failed).
        """
        self.history[slots, positions] = token_ids.clamp(min=0)
