"""DeepInfer engine: request lifecycle, scheduler and cache accounting (CPU), model runner and `LLM` entrypoint.

See `deepinfer_engine.outputs` for the stage chain of one step, `deepinfer_engine.engine` for one process's engine
and `deepinfer_engine.llm` for offline generation.
"""

from deepinfer_engine.block_pool import BlockPool
from deepinfer_engine.cache_manager import AllocationResult, CacheManager
from deepinfer_engine.config import CacheConfig, EngineConfig, SchedulerConfig
from deepinfer_engine.engine import Engine
from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.engine_core import EngineCore, ModelRunnerProtocol
from deepinfer_engine.generate_output import GenerateMetrics, GenerateOutput
from deepinfer_engine.llm import LLM
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
from deepinfer_engine.scheduler import Scheduler
from deepinfer_sampling import SamplingParams

__all__ = [
    "LLM",
    "PLACEHOLDER_TOKEN_ID",
    "AllocationResult",
    "BlockPool",
    "CacheConfig",
    "CacheManager",
    "CompletionOutput",
    "Engine",
    "EngineArgs",
    "EngineConfig",
    "EngineCore",
    "FinishReason",
    "GenerateMetrics",
    "GenerateOutput",
    "ModelRunnerOutput",
    "ModelRunnerProtocol",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StopCriteria",
]
