"""`Sampler`: logits → tokens, processed log-probs and per-row statuses, with no host-device sync.

Processing steps of every row, in order:

1. cast the logits to a float32 copy;
2. token blacklist (`SamplerConfig.banned_token_ids`) → −inf;
3. EOS → −inf while the request is within its first `first_n_token_no_eos` generated tokens;
4. grammar bitmask (int32 [B, ceil(V/32)], filled by `deepinfer_sampling.structured`) → −inf on disallowed columns;
5. repetition, presence and frequency penalties on the logits (before temperature, as in vLLM);
6. forced top-K (`SamplerConfig.force_top_k`): only the K largest logits survive;
7. rows with no finite logit (or with NaN / +inf) are marked `SampleStatus.INVALID_LOGITS`;
8. temperature: s = (z − max z) / T; greedy rows (T = 0) take the argmax (ties → lowest id) with a one-hot ℓ';
9. joint truncation, all measured on the temperature-scaled distribution: top-k, top-p (31-bit fixed-point mass of
   better-ranked tokens <= top_p) and min-p (p >= min_p · p_max); the kept set is the shortest of the three prefixes
   of the (descending logit, ascending id) order;
10. renormalise over the kept set: ℓ' = s − log Σ_kept exp(s), −inf elsewhere;
11. inverse-CDF sample from exp(ℓ') in 31-bit fixed point with the keyed draw
    `random_bits(seed, position, RandomStream.SAMPLE)` (`inverse_cdf.py`, `seeds.py`);
12. golden tokens replace the sample where forced; logprobs, top-N logprobs and `sum_smaller_probs` are read from ℓ'
    (clamped to >= −9999).
Steps 1–7 are `masking.preprocess_logits` for every backend; steps 8–11 run in `reference.py` (PyTorch) or in the
fused Triton kernel (`fused/`); step 12 is `logprobs.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_sampling import reference
from deepinfer_sampling._devices import same_device
from deepinfer_sampling.batch import SamplingBatch, SamplingRow
from deepinfer_sampling.config import SamplerConfig
from deepinfer_sampling.logprobs import LOGPROB_FLOOR, sum_smaller_probs, top_logprobs
from deepinfer_sampling.masking import check_bitmask, preprocess_logits
from deepinfer_sampling.seeds import RandomStream, random_bits


class SampleStatus(enum.IntEnum):
    """Per-row outcome. INVALID_LOGITS: nothing could be sampled (token −1 unless a golden token was forced)."""

    OK = 0
    INVALID_LOGITS = 1


@dataclass(frozen=True)
class SamplerOutput:
    """Results of one sampling step (B rows, N = batch.max_top_logprobs clamped to the vocabulary).

    Attributes:
        token_ids: int64 [B], the emitted tokens (−1 on invalid rows without a golden token).
        logprobs: float32 [B], processed log-prob of each emitted token, >= −9999.
        top_logprob_token_ids: int64 [B, N], best tokens by processed log-prob, ties → lowest id.
        top_logprobs: float32 [B, N], their processed log-probs, >= −9999.
        status: int32 [B], `SampleStatus` values.
        sum_smaller_probs: float32 [B] or None (only with `SamplerConfig.compute_sum_smaller_probs`).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprob_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    status: torch.Tensor
    sum_smaller_probs: torch.Tensor | None


def _resolve_backend(config: SamplerConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    # Like the kernels' registry: the fused kernels serve CUDA tensors; CPU tensors take the reference path.
    return "triton" if device.type == "cuda" and current_accelerator() is Accelerator.NVIDIA else "reference"


class Sampler:
    """Samples one token per logits row; see the module docstring for the steps.

    Args:
        config: sampler settings; the backend is resolved once here.
        vocab_size: number of logit columns V.
        device: device of the logits and of the batch tensors.
    """

    def __init__(self, config: SamplerConfig, vocab_size: int, device: torch.device | str) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        config.check_vocab(vocab_size)
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.backend = _resolve_backend(config, self.device)
        # The fused backend is batch-invariant by construction; its torch epilogue must not undo that.
        self._exact_sums = config.batch_invariant or self.backend == "triton"
        self._banned: torch.Tensor | None = None
        if config.banned_token_ids:
            banned = torch.zeros(vocab_size, dtype=torch.bool)
            banned[list(config.banned_token_ids)] = True
            self._banned = banned.to(self.device)

    def _check(self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None) -> None:
        expected = (batch.num_rows, self.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected or not same_device(logits.device, self.device):
            raise ValueError(
                f"logits must be [{expected[0]}, {expected[1]}] on {self.device}, got "
                f"{tuple(logits.shape)} on {logits.device}"
            )
        if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
        if batch.vocab_size != self.vocab_size or not same_device(batch.device, self.device):
            raise ValueError(
                f"batch was built for vocab {batch.vocab_size} on {batch.device}, "
                f"sampler has vocab {self.vocab_size} on {self.device}"
            )
        if bitmask is not None:
            check_bitmask(bitmask, batch.num_rows, self.vocab_size, self.device)

    def processed_logprobs(
        self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The processed distribution ℓ' of every row (steps 1–10), e.g. the target distribution for verification.

        Args:
            logits: [B, V] float32 / bfloat16 / float16.
            batch: the step's sampling batch.
            bitmask: optional int32 [B, ceil(V / 32)] grammar bitmask.

        Returns:
            (log-probs float32 [B, V], −inf outside the kept set and on invalid rows; invalid bool [B]).
        """
        self._check(logits, batch, bitmask)
        z, invalid = preprocess_logits(logits, batch, self._banned, bitmask, self.config.force_top_k)
        logprobs = reference.processed_logprobs(z, batch, self._exact_sums)
        return logprobs.masked_fill_(invalid[:, None], float("-inf")), invalid

    def processed_is_raw_argmax(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether `processed_logprobs` of these rows without a bitmask is, on every valid row, one-hot at the argmax
        of the raw logits (ties → lowest id), so that a caller may take that argmax instead. Decided on the host.

        True when no token is banned and every row is greedy, masks no EOS (`first_n_token_no_eos`) and has no
        penalty state: then steps 2–5 leave the logits' order as it is (penalties over no tokens change at most the
        sign of a zero, forced top-K keeps the largest logit) and a greedy row's distribution is one-hot at the
        argmax. Invalid rows (NaN, +inf or no finite logit) stay all −inf either way.

        Args:
            rows: the rows, as `SamplingBatch.build` would get them.
        """
        if self._banned is not None:
            return False
        return all(
            row.params.is_greedy
            and row.num_generated_tokens >= row.params.first_n_token_no_eos
            and not (row.params.has_penalties and (row.output_token_ids or row.prompt_token_ids))
            for row in rows
        )

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Samples every row.

        Args:
            logits: [B, V] float32 / bfloat16 / float16 (not modified).
            batch: the step's sampling batch.
            bitmask: optional int32 [B, ceil(V / 32)] grammar bitmask (bit set = allowed).

        Returns:
            The step's `SamplerOutput`.
        """
        self._check(logits, batch, bitmask)
        z, invalid = preprocess_logits(logits, batch, self._banned, bitmask, self.config.force_top_k)
        need_logprobs = batch.max_top_logprobs > 0 or self.config.compute_sum_smaller_probs
        logprobs: torch.Tensor | None
        if self.backend == "triton":
            from deepinfer_sampling.fused.triton_sampler import fused_sample

            tokens, token_logprobs, logprobs = fused_sample(z, batch, need_logprobs)
        else:
            bits = random_bits(batch.seeds, batch.positions, RandomStream.SAMPLE, 1)[:, 0]
            sampled, logprobs = reference.sample(z, batch, bits, self._exact_sums)
            forced = batch.forced_token_ids
            tokens = torch.where(forced >= 0, forced, sampled) if batch.has_forced_tokens else sampled
            token_logprobs = logprobs.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
        forced_or_none = batch.forced_token_ids
        tokens = torch.where(invalid, forced_or_none, tokens)
        token_logprobs = torch.where(invalid, LOGPROB_FLOOR, token_logprobs.clamp(min=LOGPROB_FLOOR))
        num_top = min(batch.max_top_logprobs, self.vocab_size)
        if logprobs is not None:
            logprobs.masked_fill_(invalid[:, None], float("-inf"))
            top_ids, top_values = top_logprobs(logprobs, num_top)
        else:
            top_ids = torch.empty((batch.num_rows, 0), dtype=torch.int64, device=self.device)
            top_values = torch.empty((batch.num_rows, 0), dtype=torch.float32, device=self.device)
        smaller = None
        if self.config.compute_sum_smaller_probs and logprobs is not None:
            smaller = sum_smaller_probs(logprobs, tokens, self._exact_sums)
        return SamplerOutput(
            token_ids=tokens,
            logprobs=token_logprobs,
            top_logprob_token_ids=top_ids,
            top_logprobs=top_values,
            status=invalid.to(torch.int32) * int(SampleStatus.INVALID_LOGITS),
            sum_smaller_probs=smaller,
        )
