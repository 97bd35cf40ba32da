"""The model runner: `SchedulerOutput` → persistent buffers → `ForwardBatch` → model → `Sampler` → results.

`ModelRunner` implements `deepinfer_engine.engine_core.ModelRunnerProtocol`. One `execute`:

1. drop the state of finished requests; register requests scheduled for the first time (from their
   `NewRequestData`: parameters, seed, prompt, grammar); apply block-table deltas (cut at `first_new_block_index`,
   extend by `new_block_ids`);
2. fill the host buffers, copy them without blocking, resolve input ids through the on-device token history
   (placeholders read the token the step in flight sampled, `deepinfer_engine.input_batch`);
3. launch the forward for the last token of every request that samples;
4. launch sampling (`deepinfer_sampling.Sampler`), write the sampled tokens into the history, start the copies of
   the results to pinned host memory and record an event.

`wait` blocks on that event and builds the `ModelRunnerOutput`: emitted tokens, their logprobs and top logprobs, the
prompt logprobs of the step, the next drafts and the requests that failed. Nothing in `execute` synchronizes with
the device, and nothing leaves the runner except through `wait`.

CUDA graphs (`deepinfer_engine.cuda_graphs`): unless `enforce_eager`, a CUDA runner whose experts are all local
captures decode forwards at start; a pure decode step without prompt-logprob rows is padded to a graph size and
replayed, every other step runs eagerly. `close` releases the graphs.

Host-dependent sampling. Two inputs of sampling need the request's earlier tokens on the host: structured output (the
grammar matcher must have accepted every earlier token before it can fill the bitmask) and penalties (token counts).
Under asynchronous scheduling step N+1 is launched before step N's token reaches the host, so for a step that has such a
row sampling is *deferred*: its forward is launched in `execute`, and its sampling right after the previous step's
results arrive, at the end of `wait(previous)` — before the following `execute` launches anything that reads the
history. The bitmask is filled on the CPU while the forward runs (docs/design/sampling.md, "Bitmask per step"); without
a step in flight sampling follows the forward at once. A verify row j of such a request counts drafts 1 … j as its
earlier tokens: they follow the known tokens in `RunnerRequest.tokens` (the step's inputs, or for placeholder inputs
the drafts `wait` received from the step before).

Prompt logprobs (docs/design/sampling.md, "Prompt logprobs"): for a request that asks for them, every prompt position of
each prefill chunk that has a next prompt token gets a logits row too (after the sampling rows); the processed log-prob
of that next token under the request's own temperature/top-k/top-p is computed right after the forward and reported with
the step (`deepinfer_engine.sampling_rows`; recomputed identically after a preemption).

Speculative decoding (`max_num_draft_tokens` = nextn > 0): a sampling request that verifies `d` drafts gets `d + 1`
logits rows (its last `d + 1` positions), and `deepinfer_engine.speculative.Speculator` replaces the plain sampler:
it verifies the drafts, emits the accepted ones plus one token, and drafts the next `nextn` with the DSpark blocks
(reported as `ModelRunnerOutput.draft_token_ids`). Steps with drafts run eagerly. Under asynchronous scheduling the
positions of placeholder requests are optimistic; the device shifts them (see `deepinfer_engine.speculative`) and
the host records are shifted by `RunnerRequest.num_rejected` once the step before is waited for.

Failures of one request never stop the step: a grammar that rejects a committed token, or a row with nothing left to
sample (every logit masked), is reported in the step's `ModelRunnerOutput.failures` with no token; the scheduler
finishes that request with an error.

A step that raises (out of memory, a kernel error, an interrupt) leaves the runner with half-launched work; `reset`
forgets every step and request so the engine can go on (`deepinfer_engine.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from itertools import accumulate

import torch

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.cuda_graphs import DraftGraphs, StepGraphs, capture_graphs, graph_sizes
from deepinfer_engine.input_batch import StepBuffers
from deepinfer_engine.outputs import ModelRunnerOutput, RequestFailure, SchedulerOutput
from deepinfer_engine.request import RequestStatus, TopLogprobs
from deepinfer_engine.runner_state import RunnerRequest, StepHandle, copy_to_host, start_request
from deepinfer_engine.sampling_rows import (
    add_prompt_rows,
    fill_bitmask,
    model_logprobs_for_greedy_rows,
    prompt_logprob_values,
)
from deepinfer_engine.speculative import SpecRequest, Speculator
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.state import ModelState
from deepinfer_sampling import Sampler, SamplingBatch, SamplingRow

__all__ = ["ModelRunner", "StepHandle"]


class ModelRunner:
    """Runs scheduled steps of one model on one device.

    Args:
        model: the loaded model.
        state: its cache pools (`config.num_blocks` blocks, `config.cache.num_state_slots` slots).
        config: the engine config.
    """

    def __init__(self, model: DeepseekV41ForCausalLM, state: ModelState, config: EngineConfig) -> None:
        self.model = model
        self.state = state
        self.config = config
        self.device = torch.device(config.device)
        text = model.config.text
        self.vocab_size = text.vocab_size
        self.sampler = Sampler(config.sampler, self.vocab_size, self.device)
        sched = config.scheduler
        block_size = config.cache.block_size
        self.buffers = StepBuffers(
            max_num_tokens=sched.max_num_batched_tokens,
            max_num_requests=sched.max_num_seqs,
            max_blocks_per_request=-(-(sched.max_model_len + 2) // block_size),
            num_state_slots=config.cache.num_state_slots,
            max_positions=sched.max_model_len + 2 + sched.max_num_draft_tokens,  # drafts sit after the last token
            ngram_context=(text.engram_max_ngram_size or 1) - 1 if text.engram_enabled else 0,
            device=self.device,
        )
        self._requests: dict[str, RunnerRequest] = {}
        self._failed: set[str] = set()  # requests reported failed, until the scheduler says they finished
        self._unwaited: list[StepHandle] = []
        nextn = sched.max_num_draft_tokens
        self.graphs: StepGraphs | None = None
        draft_graphs: DraftGraphs | None = None
        if not config.enforce_eager and self.device.type == "cuda" and model.supports_graphs():
            sizes = graph_sizes(sched.max_num_seqs, config.cudagraph_batch_size_interval)
            draft_sizes = graph_sizes(sched.max_num_seqs, config.draft_cudagraph_batch_size_interval)
            self.graphs, draft_graphs = capture_graphs(
                model, state, self.buffers, (sizes, draft_sizes), sched.max_model_len, nextn
            )
        self.speculator: Speculator | None = None
        if nextn:
            self.speculator = Speculator(
                model,
                state,
                self.buffers,
                self.sampler,
                nextn,
                config.cache.num_state_slots,
                graphs=draft_graphs,
                confidence_temperatures=config.confidence_temperatures,
            )

    def close(self) -> None:
        """Release the CUDA graphs (call before tearing down process groups)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.speculator is not None:
            self.speculator.close()

    def reset(self) -> None:
        """Forget every launched step and every request, after a step raised (the engine aborts the requests).

        Device work already queued runs to its end first; the cache contents are left as they are (the scheduler
        hands the blocks out afresh and every new request rewrites what it reads).
        """
        if self.device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a device in an error state reports it again here
                torch.cuda.synchronize(self.device)
        self._unwaited.clear()
        self._requests.clear()
        self._failed.clear()

    # ---- the protocol ----------------------------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step without blocking (see the module docstring)."""
        for request_id in scheduler_output.finished_request_ids:
            self._requests.pop(request_id, None)
            self._failed.discard(request_id)
        handle = StepHandle(scheduler_output, [], [])
        if scheduler_output.is_empty:
            self._unwaited.append(handle)
            return handle
        with torch.inference_mode():
            logits = self._forward(scheduler_output, handle)
            handle.logits = logits
            if not self._must_defer(handle):
                self._sample(handle)
        self._unwaited.append(handle)
        return handle

    def wait(self, handle: StepHandle) -> ModelRunnerOutput:
        """Block until `handle`'s step finished and report its results."""
        if not self._unwaited or self._unwaited[0] is not handle:
            raise RuntimeError("wait must be called once per step, in launch order")
        self._unwaited.pop(0)
        if handle.forward_done is not None:
            # Also for steps that sample nothing: the host buffers they uploaded from are reused two steps later.
            handle.forward_done.synchronize()
        scheduler_output = handle.scheduler_output
        index_of = {s.request_id: i for i, s in enumerate(scheduler_output.scheduled_requests)}
        num_scheduled = len(scheduler_output.scheduled_requests)
        prompt_per_request: list[list[tuple[int, float]]] = [[] for _ in range(num_scheduled)]
        if handle.prompt_values is not None:
            for (request_id, position), value in zip(handle.prompt_rows, handle.prompt_values.tolist(), strict=True):
                prompt_per_request[index_of[request_id]].append((position, value))
        if handle.logits is not None and handle.sampled is None:
            with torch.inference_mode():
                self._sample(handle)
        sampled_per_request: list[tuple[int, ...]] = [()] * num_scheduled
        logprobs_per_request: list[tuple[float, ...]] = [()] * num_scheduled
        top_per_request: list[tuple[TopLogprobs, ...]] = [()] * num_scheduled
        drafts_per_request: list[tuple[int, ...]] = [()] * num_scheduled
        confidences_per_request: list[tuple[float, ...]] = [()] * num_scheduled
        if handle.sampled is not None:
            sampled = handle.sampled
            if sampled.event is not None:
                sampled.event.synchronize()
            tokens = sampled.token_ids.tolist()
            logprobs = sampled.logprobs.tolist()
            accepted = sampled.num_accepted.tolist() if sampled.num_accepted is not None else None
            drafts = sampled.draft_ids.tolist() if sampled.draft_ids is not None else None
            confidences = sampled.draft_confidences.tolist() if sampled.draft_confidences is not None else None
            top_ids, top_values = sampled.top_ids.tolist(), sampled.top_values.tolist()
            row = 0
            samples = zip(handle.sample_indices, handle.sample_positions, handle.num_drafts, strict=True)
            for k, (index, first, num_drafts) in enumerate(samples):
                scheduled = scheduler_output.scheduled_requests[index]
                request_id = scheduled.request_id
                request = self._requests.get(request_id)
                if request is not None and scheduled.num_placeholder_tokens:
                    first -= request.num_rejected  # optimistic positions (outputs.py, "Placeholders")
                emitted = tokens[row : row + 1 + (accepted[k] if accepted is not None else 0)]
                if min(emitted) < 0 and request_id not in handle.failures:
                    handle.failures[request_id] = RequestFailure(
                        RequestStatus.FINISHED_ERROR,
                        "no token could be sampled: every logit was masked or not finite",
                    )
                if request_id in handle.failures:
                    emitted = []  # a failed request keeps no token (the history holds 0 there, never read again)
                num_top = request.params.top_logprobs if request is not None else 0
                for j, token in enumerate(emitted):
                    self._record(request_id, first + j, token)
                sampled_per_request[index] = tuple(emitted)
                logprobs_per_request[index] = tuple(logprobs[row : row + len(emitted)])
                top_per_request[index] = tuple(
                    tuple(zip(top_ids[r][:num_top], top_values[r][:num_top], strict=True))
                    for r in range(row, row + len(emitted))
                )
                if drafts is not None:
                    drafts_per_request[index] = tuple(drafts[k])
                    assert confidences is not None
                    confidences_per_request[index] = tuple(confidences[k])
                    if request is not None and request.needs_host_history and emitted:
                        # The next step's verify rows see these drafts as committed (`_sample`); a step planned
                        # before this one was waited for has only placeholders for them.
                        request.tokens.extend(drafts[k])
                row += num_drafts + 1
                if request is not None and accepted is not None:
                    request.num_rejected = num_drafts - accepted[k]
        self._failed.update(handle.failures)
        if self._unwaited and self._unwaited[0].logits is not None and self._unwaited[0].sampled is None:
            with torch.inference_mode():
                self._sample(self._unwaited[0])  # deferred sampling of the next step (module docstring)
        return ModelRunnerOutput(
            request_ids=tuple(index_of),
            sampled_token_ids=tuple(sampled_per_request),
            logprobs=tuple(logprobs_per_request),
            draft_token_ids=tuple(drafts_per_request) if self.speculator is not None else None,
            top_logprobs=tuple(top_per_request),
            prompt_logprobs=tuple(tuple(pairs) for pairs in prompt_per_request),
            failures=dict(handle.failures),
            draft_confidences=tuple(confidences_per_request) if self.speculator is not None else None,
        )

    # ---- step parts ------------------------------------------------------------------------------------------

    def _forward(self, scheduler_output: SchedulerOutput, handle: StepHandle) -> torch.Tensor:
        host = self.buffers.host_set(scheduler_output.step)
        num_tokens = 0
        max_query = max_context = 0
        has_prefill = False
        for index, scheduled in enumerate(scheduler_output.scheduled_requests):
            request = start_request(self._requests, scheduled, self.buffers.max_blocks_per_request)
            n = scheduled.num_scheduled_tokens
            start = scheduled.num_computed_tokens
            end = start + n
            host.token_ids[num_tokens : num_tokens + n] = torch.tensor(scheduled.input_token_ids, dtype=torch.int64)
            host.token_slots[num_tokens : num_tokens + n] = request.slot
            host.positions[num_tokens : num_tokens + n] = torch.arange(start, end, dtype=torch.int64)
            if scheduled.num_placeholder_tokens == 0:
                request.tokens[start:end] = scheduled.input_token_ids
            num_tokens += n
            host.cu_query_lens[index + 1] = num_tokens
            host.context_lens[index] = end
            host.known_lens[index] = scheduled.num_known_tokens
            # A decode or verify chunk starts at the last known token; anything before it is a prefill chunk.
            has_prefill |= start < scheduled.num_known_tokens - 1
            host.state_slots[index] = request.slot
            table = host.block_table[index]
            table.zero_()
            table[: len(request.block_ids)] = torch.tensor(request.block_ids, dtype=torch.int32)
            max_query, max_context = max(max_query, n), max(max_context, end)
            if scheduled.samples_token:
                d = scheduled.num_draft_tokens
                rows = len(handle.sample_indices) + sum(handle.num_drafts)
                host.logits_rows[rows : rows + d + 1] = torch.arange(num_tokens - d - 1, num_tokens)
                handle.sample_indices.append(index)
                handle.sample_positions.append(end - d)
                handle.num_drafts.append(d)
        host.cu_query_lens[0] = 0
        num_samples = len(handle.sample_indices) + sum(handle.num_drafts)
        num_logits = add_prompt_rows(scheduler_output, self._requests, handle, host.logits_rows, num_samples)
        num_requests = len(scheduler_output.scheduled_requests)
        size = None
        if self.graphs is not None and num_tokens == num_requests * max_query and num_logits == num_samples:
            size = self.graphs.size_for(num_requests, max_query, max_context)
        if size is not None:
            assert self.graphs is not None
            logits = self.graphs.replay(host, num_requests, max_query, num_logits, size)
        else:
            batch = self.buffers.upload(host, num_tokens, num_requests, num_logits, max_query, max_context, has_prefill)
            logits = self.model(batch, self.state)
        if handle.prompt_rows:
            handle.prompt_values = prompt_logprob_values(self.sampler, logits[num_samples:], handle, self._requests)
        if self.device.type == "cuda":
            handle.forward_done = torch.cuda.Event()
            handle.forward_done.record()
        return logits[:num_samples]

    def _must_defer(self, handle: StepHandle) -> bool:
        if not self._unwaited:
            return False
        scheduled = handle.scheduler_output.scheduled_requests
        return any(self._requests[scheduled[i].request_id].needs_host_history for i in handle.sample_indices)

    def _sample(self, handle: StepHandle) -> None:
        logits = handle.logits
        assert logits is not None
        if not handle.sample_indices:  # a step of prefill chunks that end before their prompts do
            handle.logits = None
            return
        scheduled = handle.scheduler_output.scheduled_requests
        rows: list[SamplingRow] = []
        bitmask_rows: list[tuple[int, RunnerRequest, str, int, list[int]]] = []
        specs = []
        ends = list(accumulate(s.num_scheduled_tokens for s in scheduled))
        samples = zip(handle.sample_indices, handle.sample_positions, handle.num_drafts, strict=True)
        # Host-side inputs need the true position: known here once every step before this one was waited for
        # (`_must_defer`); otherwise the optimistic one stands (`num_rejected` would belong to an older step, whose
        # draft count may differ under confidence-scheduled verification). The device shifts the rows' random keys
        # itself (`Speculator.sample`).
        known = not self._unwaited or self._unwaited[0] is handle
        for index, first, num_drafts in samples:
            request_id = scheduled[index].request_id
            request = self._requests[request_id]
            placeholder = scheduled[index].num_placeholder_tokens > 0
            true_first = first - (request.num_rejected if placeholder and known else 0)
            # Row j sees drafts 1 … j as committed: they follow the known tokens in `request.tokens` (written by
            # `_forward`, or by `wait` for placeholder inputs).
            if request.matcher is not None:
                drafts = request.tokens[true_first : true_first + num_drafts]
                bitmask_rows.append((len(rows), request, request_id, true_first, drafts))
            for j in range(num_drafts + 1):
                outputs: Sequence[int] = ()
                if request.params.has_penalties:
                    outputs = request.tokens[request.prompt_len : true_first + j]
                rows.append(
                    SamplingRow(
                        params=request.params,
                        seed=request.seed,
                        position=first + j,
                        num_generated_tokens=true_first + j - request.prompt_len,
                        output_token_ids=outputs,
                        prompt_token_ids=request.tokens[: request.prompt_len] if request.params.has_penalties else (),
                    )
                )
            specs.append(SpecRequest(request, index, first, num_drafts, ends[index] - num_drafts, placeholder))
        batch = SamplingBatch.build(rows, self.vocab_size, self.device)
        bitmask = None
        if bitmask_rows:
            bitmask = fill_bitmask(bitmask_rows, len(rows), self.vocab_size, self.device, self._failed, handle.failures)
        handle.logits = None
        if self.speculator is not None:
            handle.sampled = self.speculator.sample(logits, batch, bitmask, specs)
            return
        output = self.sampler(logits, batch, bitmask)
        slots = [self._requests[scheduled[i].request_id].slot for i in handle.sample_indices]
        self.buffers.record_sampled(self._to_device(slots), self._to_device(handle.sample_positions), output.token_ids)
        token_logprobs, top_ids, top_values = output.logprobs, output.top_logprob_token_ids, output.top_logprobs
        if any(row.params.is_greedy for row in rows):
            token_logprobs, top_ids, top_values = model_logprobs_for_greedy_rows(
                logits, batch.temperature == 0, output.token_ids, token_logprobs, top_ids, top_values
            )
        handle.sampled = copy_to_host(output.token_ids, token_logprobs, top_ids, top_values)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 [len(values)] on the device, copied from pinned memory without blocking on CUDA."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _record(self, request_id: str, position: int, token: int) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if position < len(request.tokens):
            request.tokens[position] = token
            del request.tokens[position + 1 :]
        else:
            request.tokens.append(token)
