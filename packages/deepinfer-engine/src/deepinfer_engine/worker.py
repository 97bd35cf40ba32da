"""One rank of a data-/expert-/context-parallel world: its process main loop.

Every rank builds an `Engine` over its share of the requests (its own scheduler, cache and model runner) with the
routed experts the EP placement gives it, stepping in lockstep with the other ranks (`deepinfer_engine.lockstep`).

Context parallelism (docs/design/parallelism.md, "Context parallelism"): the `cp` ranks of one DP rank (global ranks
dp_index·cp … dp_index·cp + cp − 1) all receive the DP rank's share of the requests and run identical engines: the same
deterministic scheduler over the same requests, the same cache layout, the same logits (the model gathers the sampled
rows to every CP rank), so the same sampled tokens — no step broadcast is needed. The model splits each step holding a
prefill chunk over the CP group (`deepinfer_model.deepseek_v41.context_parallel`); decode steps run whole on every CP
rank. Only CP rank 0's outputs are returned (`deepinfer_engine.executor`).

`rank_main` is the entry point of a rank process started by `deepinfer_engine.executor.ParallelExecutor`.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from deepinfer_engine.engine import Engine
from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.envs import read_env
from deepinfer_engine.eplb import EplbSettings, engine_expert_layout
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups
from deepinfer_parallel.launcher import destroy_distributed, init_distributed

__all__ = ["parallel_config", "rank_device", "rank_main"]

_MASTER_ADDR = "127.0.0.1"
_COLLECTIVE_TIMEOUT_S = 600.0


def parallel_config(args: EngineArgs) -> ParallelConfig:
    """The world of `args`: dp · cp processes (rank = dp_index · cp + cp_index).

    `data_parallel_size=1` with `expert_parallel_size=N` means max(1, N // cp) attention-DP ranks (EP alone implies
    as many DP ranks as the EP group holds CP groups; docs/design/parallelism.md, "Group layout").

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
    "eplb_stats" ("ok", `Engine.eplb_stats()`); None ends the loop.
    """
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
        engine = Engine(args, read_env(), model_dir, expert_parallel, groups.data_parallel_cpu, eplb)
        engine.model.context_parallel = groups.context_parallel
        conn.send(("ready", None))
        while (message := conn.recv()) is not None:
            try:
                if message == "eplb_stats":
                    conn.send(("ok", engine.eplb_stats()))
                    continue
                indices, texts, ids, params, streams, first_request_id = message
                conn.send(
                    ("ok", engine.generate(indices, texts, ids, params, streams, first_request_id, use_tqdm=False))
                )
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        destroy_distributed()
