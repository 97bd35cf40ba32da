"""Every ``DEEPINFER_*`` environment variable, declared once: the only module of DeepInfer that reads them.

Each variable has a type, a default, a line of documentation and a status:

- ``supported``: parsed and validated here into :class:`EnvSettings`, which the entrypoint folds into the engine's
  frozen configs. Inner code never sees the environment.
- ``unsupported``: a variable of DeepSeek's reference runtime whose feature DeepInfer does not have (yet). Setting it
  to anything but its default is an error that says why, rather than a silently ignored knob.
- ``not_applicable``: read by the reference only for machinery DeepInfer does not have (C++ logging, HTTP
  profiling); setting it changes nothing here and is allowed (the reason is documented).

``DEEPINFER_ACCELERATOR`` is the one exception to "only this module": ``deepinfer_kernels.platform`` reads it, because
the kernels choose their backend before (and without) any engine. It is declared here too so that the table in
``docs/env.md`` is complete, and is validated by the same rule.

Booleans accept ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case); anything else is an error. (The reference
treats every string except ``0``/``false``/``False``/empty as true, so ``DEEPINFER_X=no`` enables X there; we refuse
to guess.) ``python -m deepinfer_engine.envs`` prints the markdown table kept in ``docs/env.md``.
"""

from __future__ import annotations

import difflib
import enum
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_VARS", "EnvSettings", "EnvStatus", "EnvVar", "markdown_table", "read_env"]


class EnvStatus(enum.Enum):
    SUPPORTED = "supported"
    UNSUPPORTED = "unsupported"
    NOT_APPLICABLE = "not applicable"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected a boolean ({'/'.join(sorted(_TRUE))} or {'/'.join(sorted(_FALSE))}), got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _parse_str(text: str) -> str:
    return text


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(repr(a) for a in allowed)}, got {text!r}")
        return value

    return parse


def _at_least(minimum: float, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        value = parse(text)
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return checked


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: how to parse it, its default, what it does and whether DeepInfer honours it.

    Attributes:
        name: the variable name.
        type_name: the type shown in docs/env.md.
        default: the value when unset (or empty).
        doc: what it does.
        parse: text -> value; raises ValueError with what is allowed.
        status: whether DeepInfer honours it.
        note: for unsupported / not-applicable variables, why; for supported ones, where it lands.
    """

    name: str
    type_name: str
    default: Any
    doc: str
    parse: Callable[[str], Any]
    status: EnvStatus
    note: str = ""

    def read(self, environ: Mapping[str, str]) -> Any:
        text = environ.get(self.name)
        if text is None or text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={text!r} is invalid: {exc}") from None


_S, _U, _NA = EnvStatus.SUPPORTED, EnvStatus.UNSUPPORTED, EnvStatus.NOT_APPLICABLE

# One declaration per line reads as a table; the formatter would spread each over seven lines.
# fmt: off
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("DEEPINFER_ACCELERATOR", "str", "", "kernel backend: nvidia, ascend or cpu; auto-detected when unset",
           _choice("nvidia", "ascend", "cpu"), _S, "read by deepinfer_kernels.platform"),
    EnvVar("DEEPINFER_HF_MODEL_DIR", "path", None, "local copy of the checkpoint used instead of a hub download",
           _parse_str, _S, "model resolution in LLM(...)"),
    EnvVar("DEEPINFER_BATCH_INVARIANT", "bool", False, "bit-identical per-request outputs whatever the batch",
           _parse_bool, _S, "SamplerConfig.batch_invariant (fixed sampler reductions) and the model's "
           "batch_invariant (CPU: FP64 products, sums and transcendentals; NVIDIA: fixed-tile GEMMs and attention, "
           "FP64 reductions; docs/reproducible.md)"),
    EnvVar("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "bool", True, "asynchronous scheduling (schedule N+1 while N runs)",
           _parse_bool, _S, "EngineCore async mode"),
    EnvVar("DEEPINFER_XGRAMMAR_TIMEOUT", "float s", 20.0, "max wait for one grammar compilation",
           _at_least(0.001, _parse_float), _S, "StructuredOutputConfig.compile_timeout_s"),
    EnvVar("DEEPINFER_XGRAMMAR_DISABLE_CACHE", "bool", False, "disable the compiled-grammar cache",
           _parse_bool, _S, "StructuredOutputConfig.cache_limit_bytes = 0"),
    EnvVar("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", "int", 10 << 30, "compiled-grammar cache limit; <= 0 unbounded",
           _parse_int, _S, "StructuredOutputConfig.cache_limit_bytes"),
    EnvVar("DEEPINFER_SO_BUILDER_CPUS", "int", 4, "grammar-compile worker threads",
           _at_least(1, _parse_int), _S, "StructuredOutputConfig.num_compile_threads"),
    EnvVar("DEEPINFER_NUM_STATE_SLOTS_RATIO", "float", 1.2, "state slots = int(max_num_seqs x ratio) + 1",
           _at_least(1.0, _parse_float), _S, "CacheConfig.num_state_slots"),
    EnvVar("DEEPINFER_ENGRAM_PAD_TOKEN", "int", 2, "raw pad id for Engram n-gram windows",
           _at_least(0, _parse_int), _S, "the model's Engram pad id"),
    EnvVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "choice", "off", "YOCO prefill truncation: off / mask / compact",
           _choice("off", "mask", "compact"), _S, "EngineConfig.prefill_truncation; refuses prompt_logprobs"),
    EnvVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "int", 0,
           "prompt tail the YOCO consumer layers see; >= sliding_window + backtracking tokens when truncating",
           _parse_int, _S, "EngineConfig.prefill_truncation"),
    EnvVar("DEEPINFER_MAX_BACKTRACKING_TOKENS", "int", 0, "extra ring capacity for rollback of drafts",
           _at_least(0, _parse_int), _U, "the rings hold nextn + 1 rollback positions, sized from nextn"),
    EnvVar("DEEPINFER_USE_NEXTN_DECODE", "int", 5, "DSpark draft tokens per step; 0 disables speculation",
           _at_least(0, _parse_int), _S, "default of the nextn argument; 0 on a checkpoint without DSpark blocks"),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN", "bool", False, "confidence-scheduled variable verification",
           _parse_bool, _S, "EngineConfig.mtp_varlen (or the mtp_varlen argument); one-process engines"),
    EnvVar("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "str", "1.0", "confidence-head temperature(s)",
           _parse_str, _S, "EngineConfig.confidence_temperatures; a list needs exactly nextn values"),
    EnvVar("DEEPINFER_COMPUTE_SUM_SMALLER_PROBS", "bool", False, "report sum_smaller_probs / drafter logprobs",
           _parse_bool, _U, "these per-token statistics are not reported"),
    EnvVar("DEEPINFER_SAMPLER_FORCE_TOPK", "int", 0, "restrict sampling and logprobs to the top-K logits",
           _at_least(0, _parse_int), _S, "SamplerConfig.force_top_k"),
    EnvVar("DEEPINFER_DECODE_TOKEN_BLACKLIST", "str", "", "banned token ids, e.g. 0..3,7",
           _parse_str, _S, "SamplerConfig.banned_token_ids"),
    EnvVar("DEEPINFER_ENFORCE_EAGER", "bool", False, "never capture CUDA graphs (decode steps run eagerly)",
           _parse_bool, _S, "EngineConfig.enforce_eager (or the enforce_eager argument)"),
    EnvVar("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "int", 8, "decode graph size spacing",
           _at_least(1, _parse_int), _S, "EngineConfig.cudagraph_batch_size_interval"),
    EnvVar("DEEPINFER_DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL", "int", 8, "drafter graph size spacing",
           _at_least(1, _parse_int), _S, "EngineConfig.draft_cudagraph_batch_size_interval"),
    EnvVar("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE", "int", 100,
           "EPLB statistics window in counted steps; in [1, interval] when rearrangement is on",
           _at_least(0, _parse_int), _S, "EplbSettings.schedule.window_size"),
    EnvVar("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "int", 0,
           "EPLB period in counted steps (first after max(1, interval // 4)); 0 disables",
           _at_least(0, _parse_int), _S, "EplbSettings.schedule.step_interval; EP ranks only (EP size > 1)"),
    EnvVar("DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE", "bool", False,
           "count prefill steps and rearrange on the next step without a prefill",
           _parse_bool, _S, "EplbSettings.rearrange_after_prefill; needs the interval > 0"),
    EnvVar("DEEPINFER_REARRANGE_P2P_GROUPS", "int", 1, "P2P buckets during the EPLB weight shuffle",
           _at_least(1, _parse_int), _S, "EplbSettings.schedule.num_p2p_groups"),
    EnvVar("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "int", 0,
           "minimum redundant experts (rounded up to divide over the EP ranks)",
           _at_least(0, _parse_int), _S, "EplbSettings.min_redundant_experts; parallel engines only"),
    EnvVar("DEEPINFER_MOE_LB_STAT_INTERVAL", "int", 128, "steps between MoE load-balance metric flushes",
           _at_least(1, _parse_int), _U, "no periodic load-balance log; EPLB reports its loads per rearrangement"),
    EnvVar("DEEPINFER_FORCE_IMBALANCE_RATIO", "float", 0.0, "profiling: routing biased to local experts",
           _at_least(0.0, _parse_float), _U, "profiling-only routing override not implemented"),
    EnvVar("DEEPINFER_FORCE_LOAD_BALANCE", "bool", False, "profiling: random balanced MoE routing",
           _parse_bool, _U, "profiling-only routing override not implemented"),
    EnvVar("DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K", "int", 0, "cap on summed lengths in one prefill step",
           _at_least(0, _parse_int), _U, "the scheduler's token budget is max_num_batched_tokens"),
    EnvVar("DEEPINFER_INDEX_ATTN_MEMORY_LIMIT", "int", 10 << 30, "index-attention score workspace budget",
           _at_least(1, _parse_int), _U, "no chunked index-score workspace yet"),
    EnvVar("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "int", 70, "ALL-vote prefill period in decode steps",
           _at_least(1, _parse_int), _NA, "DeepInfer mixes prefill and decode in every step"),
    EnvVar("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "int", 100, "ANY-vote prefill period in decode steps",
           _at_least(1, _parse_int), _NA, "DeepInfer mixes prefill and decode in every step"),
    EnvVar("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "bool", False, "keep Engram tables on the device",
           _parse_bool, _U, "Engram tables always live with the model's other weights"),
    EnvVar("DEEPINFER_PREFILL_STORE_EXTRA_STATE", "bool", False, "enlarge SWA rings for an external KV store",
           _parse_bool, _U, "no external KV store"),
    EnvVar("DEEPINFER_PREFILL_STORE_EXTRA_SIZE", "int", 128, "extra ring tokens for the external KV store",
           _at_least(0, _parse_int), _U, "no external KV store"),
    EnvVar("DEEPINFER_JIT_CACHE_DIR", "path", None, "root of TileLang / DeepGEMM / DeepEP JIT caches",
           _parse_str, _U, "no vendor JIT library is used yet"),
    EnvVar("DEEPINFER_NCCL_NUM_SMS", "int", 32, "NCCL CTAs per communicator",
           _at_least(1, _parse_int), _U, "NCCL communicators use their defaults"),
    EnvVar("DEEPINFER_USERBUFFER_COMM_SMS", "int", 0, "SMs for DeepEP dispatch/combine",
           _at_least(0, _parse_int), _U, "DeepEP is not used"),
    EnvVar("DEEPINFER_GLOO_TIMEOUT", "float s", 14400.0, "gloo world timeout",
           _at_least(1.0, _parse_float), _U, "the engine's collective timeout is fixed at 600 s"),
    EnvVar("DEEPINFER_DECODE_PERF_CACHE_DIR", "path", None, "disk cache of the decode cost curve",
           _parse_str, _S, "unset: <cache root>/decode_perf (the cache_dir argument or ~/.cache/deepinfer)"),
    EnvVar("DEEPINFER_DECODE_PERF_CACHE_TTL_SEC", "int", 3600, "decode cost curve cache validity",
           _at_least(0, _parse_int), _S, "older files are measured again; files older than TTL + 2 h are deleted"),
    EnvVar("DEEPINFER_DISABLE_SYNC_GUARD", "bool", False, "disable the no-host-sync guard around a step",
           _parse_bool, _U, "no sync guard is installed in the engine yet"),
    EnvVar("DEEPINFER_XGRAMMAR_DEBUG", "bool", False, "xgrammar debug printing",
           _parse_bool, _NA, "xgrammar logs through Python logging"),
    EnvVar("DEEPINFER_LOGGING_INTERVAL_STEP", "int", 100, "stats log period in steps",
           _parse_int, _NA, "progress is reported by the tqdm bar and the end-of-run summary"),
    EnvVar("DEEPINFER_GC_INTERVAL_STEP", "int", 1000, "Python GC period in steps",
           _parse_int, _NA, "the engine leaves Python's GC alone"),
    EnvVar("DEEPINFER_NCCL_MEMORY_SAMPLE_INTERVAL_STEPS", "int", 1000, "NCCL memory sampling period",
           _parse_int, _NA, "no NCCL memory sampling"),
    EnvVar("DEEPINFER_RINGBUFFER_WARNING_INTERVAL", "int s", 60, "shared-memory broadcast ring debug period",
           _parse_int, _NA, "no shared-memory broadcast ring"),
    EnvVar("DEEPINFER_PROFILE_TORCH_CUDA_MEMORY", "str", None, "record torch CUDA memory history",
           _parse_str, _NA, "use torch.cuda.memory._record_memory_history directly"),
    EnvVar("DEEPINFER_ENABLE_MEMORY_TRACING", "bool", False, "memory snapshot during profiling",
           _parse_bool, _NA, "no profiling run"),
    EnvVar("DEEPINFER_PROFILE_HTTP_ENABLE", "bool", False, "HTTP /profile endpoint",
           _parse_bool, _NA, "offline engine: no HTTP endpoint"),
    EnvVar("DEEPINFER_PROFILE_HTTP_PORT_BASE", "int", 6070, "HTTP profile endpoint port base",
           _parse_int, _NA, "offline engine: no HTTP endpoint"),
    EnvVar("DEEPINFER_TORCH_PROFILER_DIR", "path", "/tmp", "torch profiler trace directory",
           _parse_str, _NA, "offline engine: no HTTP endpoint"),
    EnvVar("DEEPINFER_USE_MULTIMODAL_POOL", "bool", False, "pinned host pool for multimodal tensors",
           _parse_bool, _NA, "text-only engine"),
    EnvVar("DEEPINFER_MULTIMODAL_POOL_SIZE_GB", "int", 8, "multimodal pool size per rank",
           _parse_int, _NA, "text-only engine"),
    EnvVar("DEEPINFER_MULTI_MODAL_BUFFER_SIZE", "int", 512, "multimodal worker queue bound",
           _parse_int, _NA, "text-only engine"),
    EnvVar("DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT", "float s", 1800.0, "multimodal worker hang timeout",
           _parse_float, _NA, "text-only engine"),
)
# fmt: on


@dataclass(frozen=True)
class EnvSettings:
    """The parsed values of every supported variable (see ``ENV_VARS``); built once, at the entrypoint."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"{name} is not a supported DEEPINFER_* variable") from None


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse every declared variable from ``environ`` (default: the process environment).

    A set ``DEEPINFER_*`` variable that is not declared here (a typo such as ``DEEPINFER_BATCH_INVARIENT``) gets a
    warning naming the closest declared one.

    Raises:
        ValueError: a malformed value (naming the variable and what is allowed), or an unsupported variable set to
            anything but its default (naming the variable and why it is unsupported).
    """
    env = os.environ if environ is None else environ
    prefix = "DEEPINFER_"
    declared = [var.name.removeprefix(prefix) for var in ENV_VARS]
    for name in sorted(set(env)):
        if name.startswith(prefix) and name.removeprefix(prefix) not in declared:
            close = difflib.get_close_matches(name.removeprefix(prefix), declared, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else "; docs/env.md lists every variable"
            warnings.warn(f"environment variable {name} is not a DeepInfer variable and is ignored{hint}", stacklevel=2)
    values: dict[str, Any] = {}
    for var in ENV_VARS:
        value = var.read(env)
        if var.status is EnvStatus.SUPPORTED:
            values[var.name] = value
        elif var.status is EnvStatus.UNSUPPORTED and value != var.default:
            raise ValueError(
                f"environment variable {var.name}={env[var.name]!r} is not supported by DeepInfer: {var.note}. "
                f"Unset it (default {var.default!r})."
            )
    return EnvSettings(values)


def markdown_table() -> str:
    """The table of docs/env.md: every variable, its type, default, status and meaning."""
    lines = ["| variable | type | default | status | meaning | note |", "|---|---|---|---|---|---|"]
    for var in ENV_VARS:
        default = "unset" if var.default in (None, "") else f"`{var.default}`"
        lines.append(f"| `{var.name}` | {var.type_name} | {default} | {var.status.value} | {var.doc} | {var.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
