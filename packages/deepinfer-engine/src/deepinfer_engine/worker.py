"""One rank of a data-/expert-/context-parallel world: its lockstep runner and its process main loop.

Every rank owns an engine over its share of the requests (its own scheduler, cache and model runner) and the
routed experts the EP placement gives it. The ranks meet in every MoE layer's all-to-all, so each rank must run
exactly one model forward per step, in lockstep with the others:

- the loop continues while *any* rank has unfinished work (`LockstepRunner.any_busy`, a MAX vote over the DP group,
  runtime §7.2);
- a rank with nothing to compute in a step (no requests left, or a schedule that came out empty) runs a *padding
  forward* instead: one token at position 0 in the null block 0 and the never-used state slot 0, whose logits are
  discarded. The model cannot run a forward of zero tokens (its Engram layers reshape an empty tensor), so one token
  is the smallest step that still enters every MoE all-to-all; the null block and slot 0 are never read by a real
  request;
- ranks step synchronously (no asynchronous scheduling), so every `EngineCore.step` launches exactly one forward.

EPLB (`deepinfer_engine.eplb`): the vote also carries whether the step just run held prompt tokens on any rank, so
every rank closes that step in the EPLB controller with the same verdict, counts the same steps and rearranges at the
same step; the rearrangement runs between two forwards, before the next step is scheduled.

Context parallelism (runtime §7.2): the `cp` ranks of one DP rank (global ranks dp_index·cp … dp_index·cp + cp − 1)
all receive the DP rank's share of the requests and run identical engines: the same deterministic scheduler over
the same requests, the same cache layout, the same logits (the model gathers the sampled rows to every CP rank), so
the same sampled tokens — no step broadcast is needed. The model splits each step holding a prefill chunk over the
CP group (`deepinfer_model.deepseek_v41.context_parallel`); decode steps run whole on every CP rank. Only CP rank 0's
outputs are returned (`deepinfer_engine.executor`).

`rank_main` is the entry point of a rank process started by `deepinfer_engine.executor.ParallelExecutor`.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.eplb import EplbController, EplbSettings, engine_expert_layout
from deepinfer_engine.model_runner import ModelRunner, StepHandle
from deepinfer_engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir
from deepinfer_model.state import ModelState
from deepinfer_parallel.comm import all_reduce_
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups, RankGroup
from deepinfer_parallel.launcher import destroy_distributed, init_distributed

__all__ = ["LockstepRunner", "padding_batch", "rank_device", "rank_main"]

_MASTER_ADDR = "127.0.0.1"
_COLLECTIVE_TIMEOUT_S = 600.0


def padding_batch(model: DeepseekV41ForCausalLM, device: torch.device) -> ForwardBatch:
    """A one-token batch that writes only the null block 0 and the never-used state slot 0.

    Returns:
        The batch: token id 0 at position 0, block table [1, 1] int32 = 0, state slot 0, one logits row.
    """
    text = model.config.text
    one = torch.zeros(1, dtype=torch.int64, device=device)
    prefix = None
    if text.engram_enabled:
        prefix = torch.full((1, (text.engram_max_ngram_size or 1) - 1), -1, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=one,
        positions=one.clone(),
        cu_query_lens=torch.tensor([0, 1], dtype=torch.int32, device=device),
        context_lens=torch.ones(1, dtype=torch.int32, device=device),
        block_table=torch.zeros((1, 1), dtype=torch.int32, device=device),
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),
        engram_prefix_ids=prefix,
        logits_indices=one.clone(),
        max_query_len=1,
        max_context_len=1,
    )


class LockstepRunner:
    """A model runner that runs one forward per step on every rank (see the module docstring).

    Args:
        runner: this rank's model runner.
        model: its model (expert-parallel).
        state: its cache pools.
        vote_group: the group that votes on unfinished work (the DP group over gloo).
        eplb: this rank's EPLB controller; None when rearrangement is off or the EP group has one rank.
    """

    def __init__(
        self,
        runner: ModelRunner,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        vote_group: RankGroup,
        eplb: EplbController | None = None,
    ) -> None:
        self.runner = runner
        self.model = model
        self.state = state
        self.vote_group = vote_group
        self.eplb = eplb
        self._padding = padding_batch(model, runner.device)
        self._stepped = False  # a forward ran since the last vote
        self._step_had_prefill = False

    def any_busy(self, busy: bool) -> bool:
        """Whether any rank of the vote group has unfinished work (collective: every rank calls it once a step).

        The vote also closes the step run since the previous vote in the EPLB controller (which may rearrange,
        collectively over the EP group), with "a prefill ran" voted over the group too.
        """
        vote = torch.tensor([int(busy), int(self._step_had_prefill)], dtype=torch.int64)
        any_busy, any_prefill = all_reduce_(vote, self.vote_group, "max").tolist()
        if self._stepped and self.eplb is not None:
            self.eplb.end_step(bool(any_prefill))
        self._stepped = self._step_had_prefill = False
        return bool(any_busy)

    def pad_step(self) -> None:
        """Run the padding forward of a step in which this rank computes nothing; its logits are discarded."""
        with torch.inference_mode():
            self.model(self._padding, self.state)
        self._stepped = True

    def execute(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """`ModelRunner.execute`, with a padding forward when the schedule is empty."""
        if scheduler_output.is_empty:
            self.pad_step()
        else:
            self._stepped = True
            self._step_had_prefill = any(
                r.num_computed_tokens < r.num_prompt_tokens for r in scheduler_output.scheduled_requests
            )
        return self.runner.execute(scheduler_output)

    def wait(self, handle: StepHandle) -> ModelRunnerOutput:
        """`ModelRunner.wait`."""
        return self.runner.wait(handle)


def parallel_config(args: EngineArgs) -> ParallelConfig:
    """The world of `args`: dp · cp processes (rank = dp_index · cp + cp_index).

    `data_parallel_size=1` with `expert_parallel_size=N` means max(1, N // cp) attention-DP ranks (runtime §1.4,
    §6.1: EP alone implies as many DP ranks as the EP group holds CP groups).

    Raises:
        ValueError: the EP size does not divide dp · cp (the message names the sizes).
    """
    cp = args.context_parallel_size
    dp = args.data_parallel_size if args.data_parallel_size > 1 else max(1, args.expert_parallel_size // cp)
    try:
        return ParallelConfig(
            world_size=dp * cp,
            data_parallel_size=dp,
            context_parallel_size=cp,
            expert_parallel_size=args.expert_parallel_size,
        )
    except ValueError as exc:
        raise ValueError(
            f"data_parallel_size={args.data_parallel_size}, expert_parallel_size={args.expert_parallel_size}, "
            f"context_parallel_size={cp}: {exc}"
        ) from exc


def rank_device(device: str, rank: int) -> torch.device:
    """The device of rank `rank` of a world whose engine device is `device`.

    CPU ranks all use the CPU; on CUDA rank r uses GPU r (one GPU per rank).

    Args:
        device: the engine's device, "cpu" or "cuda" (resolved: not None, no index).
        rank: global rank.

    Raises:
        ValueError: `device` is neither "cpu" nor "cuda".
    """
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        return torch.device("cuda", rank)
    raise ValueError(f"the device of a parallel engine must be 'cpu' or 'cuda' (rank r uses cuda:r), got {device!r}")


def rank_main(rank: int, port: int, args: EngineArgs, model_dir: Path, conn: Connection, eplb: EplbSettings) -> None:
    """Entry point of one rank process: join the world, build the rank's engine, serve `generate` shares.

    `args.device` is the resolved engine device ("cpu" or "cuda", see `rank_device`). CPU worlds use gloo, each rank
    with its share of the host's cores as torch threads; CUDA worlds bind rank r to cuda:r before building anything
    and use NCCL for the tensor collectives, with the gloo twin of the DP group
    (`ParallelGroups.data_parallel_cpu`) for the host-side vote on unfinished work.

    `eplb` (the entrypoint's `EplbSettings`) sets the replica slots of the expert layout and the rank's
    EPLB controller.

    Protocol over `conn`: the rank sends ("ready", None) once built (or ("error", traceback)); then for each
    received `(indices, texts, ids, params, first_request_id)` it sends ("ok", outputs) or ("error", traceback), for
    "eplb_stats" ("ok", `LLM.eplb_stats()`); None ends the loop.
    """
    from deepinfer_engine.llm import LLM  # here, not at the top: llm imports this module

    config = parallel_config(args)
    try:
        device = rank_device(args.device or "cpu", rank)
        backend = "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
            backend = "nccl"
            args = dataclasses.replace(args, device=str(device))
        else:
            # The ranks share the host's cores; each would otherwise start one compute thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
        init_distributed(rank, config.world_size, _MASTER_ADDR, port, backend, _COLLECTIVE_TIMEOUT_S)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        text = open_checkpoint_dir(model_dir).config.text
        groups = ParallelGroups.build(config, rank)
        placement_device = None
        if device.type == "cuda":
            groups.warm_up(device)  # NCCL communicators are created lazily; not inside the first step
            placement_device = device
        layout = engine_expert_layout(config, text.n_routed_experts, eplb)
        expert_parallel = ExpertParallelMoE.create(
            groups,
            text.n_routed_experts,
            text.num_hidden_layers,
            num_redundant_experts=layout.num_redundant_experts,
            device=placement_device,
        )
        llm = LLM.for_rank(args, model_dir, expert_parallel, groups.data_parallel_cpu, eplb)
        llm.model.context_parallel = groups.context_parallel
        conn.send(("ready", None))
        while (message := conn.recv()) is not None:
            try:
                if message == "eplb_stats":
                    conn.send(("ok", llm.eplb_stats()))
                    continue
                indices, texts, ids, params, first_request_id = message
                conn.send(("ok", llm.run_prompts(indices, texts, ids, params, first_request_id, use_tqdm=False)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        destroy_distributed()
