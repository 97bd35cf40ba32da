"""deepinfer-sampling: logits + per-request parameters in; tokens, log-probs and statuses out.

Stands on its own: it never imports a model, an engine or a tokenizer. Seeded randomness is keyed by
(request seed, position, stream), so results do not depend on how requests are batched.
"""

from deepinfer_sampling.batch import SamplingBatch, SamplingRow
from deepinfer_sampling.config import SamplerConfig, parse_token_blacklist
from deepinfer_sampling.inverse_cdf import inverse_cdf_sample
from deepinfer_sampling.logprobs import LOGPROB_FLOOR
from deepinfer_sampling.params import SAMPLING_EPS, SamplingParams, StructuredOutputSpec
from deepinfer_sampling.sampler import Sampler, SamplerOutput, SampleStatus
from deepinfer_sampling.seeds import RandomStream, random_bits, request_seed, uniforms

__all__ = [
    "LOGPROB_FLOOR",
    "SAMPLING_EPS",
    "RandomStream",
    "SampleStatus",
    "Sampler",
    "SamplerConfig",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutputSpec",
    "inverse_cdf_sample",
    "parse_token_blacklist",
    "random_bits",
    "request_seed",
    "uniforms",
]

# --- structured output (deepinfer_sampling.structured): imports and __all__ additions below this line ---
# Not re-exported: importing xgrammar costs seconds, so `import deepinfer_sampling.structured` only where grammars
# are used (the engine does it on the first request with so_args).

# --- speculative verification (deepinfer_sampling.speculative): imports and __all__ additions below this line ---

from deepinfer_sampling.speculative import (
    DecodeCostCurve,
    VerificationOutput,
    redistribute_verified_drafts,
    schedule_num_verified_drafts,
    verify_greedy,
    verify_rejection,
)

__all__ += [
    "DecodeCostCurve",
    "VerificationOutput",
    "redistribute_verified_drafts",
    "schedule_num_verified_drafts",
    "verify_greedy",
    "verify_rejection",
]
