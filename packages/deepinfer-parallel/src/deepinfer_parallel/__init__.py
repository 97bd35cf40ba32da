"""deepinfer-parallel: process groups, balanced context parallelism, MoE expert parallelism and EPLB.

Built on torch.distributed process groups (gloo on CPU, NCCL/HCCL on accelerators) that a `ParallelGroups` object
holds; it is built once per process and passed explicitly. Importing this package touches no device and starts no
communication. The EPLB parts live in `deepinfer_parallel.eplb` (policy, stats, rebalance).
"""

from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.context_parallel import (
    ContextParallelSplit,
    all_gather_to_token_order,
    balanced_split,
    gather_local_tokens,
    restore_token_order,
)
from deepinfer_parallel.expert_parallel import (
    AllToAllDispatcher,
    DispatchOutput,
    ExpertPlacement,
    TokenDispatcher,
    map_to_physical,
)
from deepinfer_parallel.groups import ParallelGroups, RankGroup
from deepinfer_parallel.launcher import init_distributed, spawn

__all__ = [
    "AllToAllDispatcher",
    "ContextParallelSplit",
    "DispatchOutput",
    "EplbConfig",
    "ExpertLayoutConfig",
    "ExpertPlacement",
    "ParallelConfig",
    "ParallelGroups",
    "RankGroup",
    "TokenDispatcher",
    "all_gather_to_token_order",
    "balanced_split",
    "gather_local_tokens",
    "init_distributed",
    "map_to_physical",
    "restore_token_order",
    "spawn",
]
