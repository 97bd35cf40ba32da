"""deepinfer-parallel: attention data parallelism, balanced context parallelism, MoE expert parallelism and EPLB.

Built on torch.distributed process groups (gloo on CPU, NCCL/HCCL on accelerators) that a `ParallelGroups` object
holds; it is built once per process and passed explicitly. Importing this package touches no device and starts no
communication. The EPLB parts live in `deepinfer_parallel.eplb` (policy, stats, rebalance).
"""

from deepinfer_parallel.attention_dp import (
    DataParallelTokenLayout,
    exchange_token_layout,
    gather_tokens,
    max_over_ranks,
    reduce_scatter_tokens,
    scatter_tokens,
)
from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.context_parallel import (
    ContextParallelSplit,
    all_gather_to_token_order,
    balanced_split,
    gather_local_tokens,
    merge_attention_partials,
    restore_token_order,
)
from deepinfer_parallel.expert_parallel import (
    AllToAllDispatcher,
    DispatchOutput,
    ExpertFn,
    ExpertPlacement,
    TokenDispatcher,
    expert_parallel_moe,
    map_to_physical,
    run_local_experts,
)
from deepinfer_parallel.groups import ParallelGroups, RankGroup
from deepinfer_parallel.launcher import init_distributed, spawn

__all__ = [
    "AllToAllDispatcher",
    "ContextParallelSplit",
    "DataParallelTokenLayout",
    "DispatchOutput",
    "EplbConfig",
    "ExpertFn",
    "ExpertLayoutConfig",
    "ExpertPlacement",
    "ParallelConfig",
    "ParallelGroups",
    "RankGroup",
    "TokenDispatcher",
    "all_gather_to_token_order",
    "balanced_split",
    "exchange_token_layout",
    "expert_parallel_moe",
    "gather_local_tokens",
    "gather_tokens",
    "init_distributed",
    "map_to_physical",
    "max_over_ranks",
    "merge_attention_partials",
    "reduce_scatter_tokens",
    "restore_token_order",
    "run_local_experts",
    "scatter_tokens",
    "spawn",
]
