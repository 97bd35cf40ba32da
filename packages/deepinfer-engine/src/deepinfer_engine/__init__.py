"""DeepInfer engine: request lifecycle, scheduler and cache accounting (CPU), model runner and `LLM` entrypoint.

See `deepinfer_engine.outputs` for the stage chain of one step.
"""

from deepinfer_engine.block_pool import BlockPool
from deepinfer_engine.cache_manager import AllocationResult, CacheManager
from deepinfer_engine.config import CacheConfig, SchedulerConfig
from deepinfer_engine.engine_core import EngineCore, ModelRunnerProtocol
from deepinfer_engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    CompletionOutput,
    ModelRunnerOutput,
    RequestMetrics,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer_engine.request import FinishReason, Request, RequestStatus, StopCriteria
from deepinfer_engine.scheduler import Scheduler, StopChecker

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "AllocationResult",
    "BlockPool",
    "CacheConfig",
    "CacheManager",
    "CompletionOutput",
    "EngineCore",
    "FinishReason",
    "ModelRunnerOutput",
    "ModelRunnerProtocol",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StopChecker",
    "StopCriteria",
]
