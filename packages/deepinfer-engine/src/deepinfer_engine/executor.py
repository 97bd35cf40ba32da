"""The driver of a data-/expert-/context-parallel `LLM`: starts the rank processes, shares out requests, gathers
outputs.

`ParallelExecutor` validates the sizes (`worker.parallel_config`, that the routed experts divide over the EP ranks,
and on CUDA that every rank gets its own visible GPU), then starts one process per rank (`worker.rank_main`) forming
a world on a free localhost port — gloo on CPU; on CUDA rank r on GPU r with NCCL (plus a gloo group for the
host-side vote); each rank loads the model with only its own routed experts. `generate` assigns the call's prompts
to the DP ranks round-robin — prompt i goes to DP rank i mod dp — sends every rank its DP rank's share (possibly
empty: idle ranks still step in lockstep; the cp ranks of one DP rank all get the same share and run the same steps),
and returns CP rank 0's outputs in input order, after checking that the other CP ranks generated the same tokens.
Request ids and seeds are those of one process
(prompt index and request number of the call), so the per-request random streams do not depend on the rank.

EPLB (`deepinfer_engine.eplb`): the executor hands every rank the entrypoint's `EplbSettings` (replica slots of the
expert layout, rearrangement schedule); `eplb_stats` asks each rank what its controller did.

Progress bars are not shown in parallel mode.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine._prompts import ParamsLike, as_params
from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.eplb import EplbSettings, EplbStats, engine_expert_layout
from deepinfer_engine.generate_output import GenerateOutput
from deepinfer_engine.worker import parallel_config, rank_main
from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir
from deepinfer_parallel.launcher import find_free_port

__all__ = ["ParallelExecutor", "assign_round_robin"]

_JOIN_TIMEOUT_S = 10.0


def assign_round_robin(num_prompts: int, num_ranks: int) -> list[list[int]]:
    """Prompt indices of each DP rank: prompt i goes to rank i mod `num_ranks`.

    Raises:
        ValueError: `num_prompts` < 0 or `num_ranks` < 1.
    """
    if num_prompts < 0 or num_ranks < 1:
        raise ValueError(f"need num_prompts >= 0 and num_ranks >= 1, got {num_prompts} and {num_ranks}")
    return [list(range(rank, num_prompts, num_ranks)) for rank in range(num_ranks)]


def _shutdown(procs: list[BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):  # the rank already exited
            conn.send(None)
    for proc in procs:
        proc.join(timeout=_JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=_JOIN_TIMEOUT_S)
    for conn in conns:
        conn.close()


def _check_devices(device: str | None, num_ranks: int) -> None:
    """Raise `ValueError` unless `device` can host `num_ranks` ranks (CPU: any number; CUDA: one visible GPU each)."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(
            f"device={device!r}: a data-/expert-parallel engine runs on 'cpu' or 'cuda' (rank r uses cuda:r; set "
            "CUDA_VISIBLE_DEVICES to choose the GPUs)"
        )
    visible = torch.cuda.device_count()
    if num_ranks > visible:
        raise ValueError(
            f"the parallel engine needs {num_ranks} ranks, one GPU each, but only {visible} CUDA device(s) are "
            "visible; lower data_parallel_size / expert_parallel_size or make more GPUs visible"
        )


def _reject_structured_output(params: Sequence[ParamsLike], cp: int) -> None:
    """CP ranks admit a structured request once its grammar has compiled, which happens at a different step on each
    rank; their schedules would diverge, so such requests are refused up front."""
    for index, params_like in enumerate(params):
        try:
            so_args = as_params(params_like).so_args
        except (TypeError, ValueError):
            continue  # the rank reports invalid parameters as that prompt's error output
        if so_args is not None:
            raise ValueError(
                f"prompt {index} asks for structured output (so_args), which context_parallel_size={cp} does not "
                "support yet (the CP ranks would admit it at different steps); use context_parallel_size=1"
            )


class ParallelExecutor:
    """Rank processes of one parallel `LLM` (see the module docstring).

    Args:
        args: the engine arguments (every rank builds its engine from them); `args.device` is the resolved engine
            device, "cpu" or "cuda" (rank r then uses cuda:r).
        model_dir: the resolved checkpoint directory.
        eplb: expert-parallel load balancing (replica slots, rearrangement schedule); off by default.

    Raises:
        ValueError: the EP size does not divide the DP size, the routed experts do not divide over the EP ranks
            (without replica slots), the device is not "cpu" or "cuda", or there are fewer visible GPUs than ranks
            (the message names the sizes).
        RuntimeError: a rank failed to start (its traceback is in the message).
    """

    def __init__(self, args: EngineArgs, model_dir: Path, eplb: EplbSettings | None = None) -> None:
        config = parallel_config(args)
        eplb = eplb if eplb is not None else EplbSettings()
        # Checked here, before any rank starts; every rank builds this same layout.
        engine_expert_layout(config, open_checkpoint_dir(model_dir).config.text.n_routed_experts, eplb)
        self.num_ranks = config.world_size
        self.context_parallel_size = config.context_parallel_size
        _check_devices(args.device, self.num_ranks)
        ctx = mp.get_context("spawn")
        port = find_free_port()
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        # Shut the ranks down when the executor is collected, even without `close`.
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns)
        for rank in range(self.num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, port, args, model_dir, child, eplb), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._receive_all()

    def generate(
        self,
        texts: Sequence[str | None],
        ids: Sequence[Sequence[int] | None],
        params: Sequence[ParamsLike],
        streams: Sequence[int],
        first_request_id: int,
    ) -> list[GenerateOutput]:
        """Run one `LLM.generate` call over the ranks; one output per prompt, in input order.

        Args:
            texts, ids, params: each prompt's text, token ids and sampling parameters.
            streams: each prompt's stream index (`deepinfer_engine._prompts.stream_indices`).
            first_request_id: the request number of the call's first prompt.

        Raises:
            ValueError: structured output requested with cp > 1.
            RuntimeError: a rank failed (its traceback is in the message), or the CP ranks of a DP rank generated
                different tokens.
        """
        cp = self.context_parallel_size
        if cp > 1:
            _reject_structured_output(params, cp)
        shares = assign_round_robin(len(ids), self.num_ranks // cp)
        for rank, conn in enumerate(self._conns):
            share = shares[rank // cp]
            conn.send(
                (
                    share,
                    [texts[i] for i in share],
                    [ids[i] for i in share],
                    [params[i] for i in share],
                    [streams[i] for i in share],
                    first_request_id,
                )
            )
        results: list[GenerateOutput | None] = [None] * len(ids)
        answers: list[list[GenerateOutput]] = self._receive_all()
        for rank, outputs in enumerate(answers):
            for index, output in zip(shares[rank // cp], outputs, strict=True):
                driver = results[index]
                if driver is None:  # CP rank 0 of the DP rank, received first
                    results[index] = output
                elif output.token_ids != driver.token_ids:
                    self.close()
                    raise RuntimeError(
                        f"CP rank {rank % cp} of DP rank {rank // cp} generated {list(output.token_ids)} for prompt "
                        f"{index}, CP rank 0 generated {list(driver.token_ids)}: the CP ranks diverged"
                    )
        return [r for r in results if r is not None]

    def eplb_stats(self) -> list[EplbStats]:
        """Each rank's EPLB statistics, in rank order; empty when EPLB is inactive (off, or EP size 1).

        Raises:
            RuntimeError: a rank failed (its traceback is in the message).
        """
        for conn in self._conns:
            conn.send("eplb_stats")
        answers: list[list[EplbStats]] = self._receive_all()
        return [stats for rank_stats in answers for stats in rank_stats]

    def close(self) -> None:
        """Stop the rank processes."""
        self._finalizer()

    def _abort(self) -> None:
        """Stop every rank at once: ranks waiting in a collective for a failed peer would not read a stop message."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        self.close()

    def _receive_all(self) -> list[Any]:
        """Every rank's answer, in rank order; the first rank that fails or dies ends the call at once.

        Ranks are waited on together: a rank blocked in a collective with a failed peer never answers, so waiting for
        ranks in order would stall until the collective timeout. On a failure every rank process is stopped (the
        engine cannot continue without it) and the failing rank's traceback is raised.
        """
        answers: dict[int, Any] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            for ready in wait(list(pending.values())):
                rank = next(r for r, c in pending.items() if c is ready)
                conn = pending.pop(rank)
                try:
                    status, payload = conn.recv()
                except EOFError as exc:
                    self._abort()
                    raise RuntimeError(
                        f"rank {rank} of {self.num_ranks} exited without answering; every rank process was stopped "
                        "and this LLM cannot be used any more. If this happened at start-up, the rank's error is "
                        "above; a script that builds a parallel LLM must do so under "
                        '`if __name__ == "__main__":` (rank processes import the main module)'
                    ) from exc
                if status == "error":
                    self._abort()
                    raise RuntimeError(
                        f"rank {rank} of {self.num_ranks} failed; every rank process was stopped and this LLM cannot "
                        f"be used any more:\n{payload}"
                    )
                answers[rank] = payload
        return [answers[rank] for rank in range(self.num_ranks)]
