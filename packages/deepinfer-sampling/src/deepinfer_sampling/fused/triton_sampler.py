"""Fused Triton sampler: temperature, joint top-k/top-p/min-p truncation, renormalisation and inverse-CDF sampling.

Same arithmetic as `reference.py` with `exact_sums=True` (fixed-point normalisers and masses), one program per row
walking the row in increasing column order in blocks of BLOCK columns, so a row's result never depends on the batch.
Per row (non-greedy):

    pass 1   m = max z
    pass 2   lse = log Σ floor(exp(s)·2^40) − 40·ln 2,  s = (z − m)/T
    pass     (only with top-k or top-p) fᵢ = floor(exp(s − lse)·2^31) into a per-row uint32 scratch, then
    passes   32 bisection steps over the order-preserving int32 key of z find
             t_k = min{v : #(key > v) < K} and t_p = min{v : Σ_{key > v} fᵢ <= P}, fᵢ = floor(exp(s − lse)·2^31);
             ties at t_k / t_p are kept in ascending id order while the count / fixed-point mass allows
    pass     lse' = log Σ_kept floor(exp(s)·2^40) − 40·ln 2
    pass     f'ᵢ = floor(exp(s − lse')·2^31) on kept tokens, r = scaled draw in [0, Σ f') (`inverse_cdf.py`),
             token = first i with CDF_i > r; optionally writes ℓ' = s − lse' (−inf outside the kept set)

Greedy rows (T = 0) take the lowest-index argmax with a one-hot ℓ'. Golden tokens replace the sample. The random draw
is `seeds.random_bits(seed, position, SAMPLE)` hashed in the kernel. Token choices match the reference except where
float rounding of exp/log moves a CDF boundary past r (each fixed-point weight can differ by a few units of 2^-31);
log-probs agree to float32 rounding.

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.
"""

# Triton types @triton.jit arguments at compile time; Python annotations on them would be ignored.
# ruff: noqa: ANN001, ANN202
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.platform import triton_interpreter_enabled
from deepinfer_sampling.batch import SamplingBatch
from deepinfer_sampling.seeds import RandomStream, stream_offset

MAX_BLOCK = 4096


@triton.jit
def _mix64(z):  # type: ignore[no-untyped-def]
    """SplitMix64 finaliser on uint64 (the same function as `seeds.mix64`)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _sample_bits(seed, position, STREAM_OFFSET: tl.constexpr):  # type: ignore[no-untyped-def]
    """Draw 0 of `seeds.random_bits(seed, position, stream)`; STREAM_OFFSET = (stream + 1)·φ' mod 2^64."""
    mixed_seed = _mix64(seed.to(tl.uint64, bitcast=True))
    key = _mix64(mixed_seed ^ (position.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15))
    key = _mix64(key + STREAM_OFFSET)
    return (_mix64(key + 0x9E3779B97F4A7C15) >> 1).to(tl.int64, bitcast=True)


@triton.jit
def _load_mass(f_row, cols, V):  # type: ignore[no-untyped-def]
    bits = tl.load(f_row + cols, mask=cols < V, other=0)
    return bits.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _keys(x):  # type: ignore[no-untyped-def]
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _fixed_lse(  # type: ignore[no-untyped-def]
    z_row,
    m,
    temperature,
    lse,
    t_k,
    n_k,
    t_p,
    mass_p,
    limit_p,
    log_min_p,
    V,
    BLOCK: tl.constexpr,
    TRUNCATE: tl.constexpr,
):
    """Σ floor(exp(s)·2^40) over kept columns, as a float32 log."""
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), dtype=tl.int64)
    seen_k = tl.zeros((), dtype=tl.int64)
    seen_p = tl.zeros((), dtype=tl.int64)
    for start in tl.range(0, V, BLOCK, num_stages=3):
        cols = start + offs
        x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
        s = tl.math.div_rn(x - m, temperature)
        kept = cols < V
        if TRUNCATE:
            kept, seen_k, seen_p = _kept(x, s, kept, t_k, n_k, t_p, mass_p, limit_p, log_min_p, seen_k, seen_p, lse)
        e = tl.where(kept, tl.exp(s), 0.0)
        total += tl.floor(e * 1099511627776.0).to(tl.int64)
    return (tl.log(tl.sum(total, axis=0).to(tl.float64)) - 40 * 0.6931471805599453).to(tl.float32)


@triton.jit
def _kept(x, s, valid, t_k, n_k, t_p, mass_p, limit_p, log_min_p, seen_k, seen_p, lse):  # type: ignore[no-untyped-def]
    """Kept mask of one block and the updated running counts of ties at t_k (count) and t_p (mass)."""
    key = _keys(x)
    eq_k = (key == t_k) & valid
    eq_k_i = eq_k.to(tl.int64)
    before_k = seen_k + tl.cumsum(eq_k_i, axis=0) - eq_k_i
    keep_k = (key > t_k) | (eq_k & (before_k < n_k))
    eq_p = (key == t_p) & valid
    f = tl.where(eq_p, tl.floor(tl.minimum(tl.exp(s - lse), 1.0) * 2147483648.0).to(tl.int64), 0)
    before_p = seen_p + tl.cumsum(f, axis=0) - f
    keep_p = (key > t_p) | (eq_p & (mass_p + before_p <= limit_p))
    kept = valid & keep_k & keep_p & (s >= log_min_p)
    return kept, seen_k + tl.sum(eq_k_i, axis=0), seen_p + tl.sum(f, axis=0)


@triton.jit
def _fused_sample_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    stride_z,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    log_min_p_ptr,
    seed_ptr,
    position_ptr,
    forced_ptr,
    token_ptr,
    token_lp_ptr,
    lp_ptr,
    stride_lp,
    scratch_ptr,
    stride_scratch,
    V,
    BLOCK: tl.constexpr,
    TRUNCATE: tl.constexpr,
    WRITE_LOGPROBS: tl.constexpr,
    STREAM_OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(temp_ptr + row)
    forced = tl.load(forced_ptr + row)
    # Passes accumulate per-lane and reduce once at the end (exact for max, min and integer sums).
    m_lanes = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=3):
        cols = start + offs
        m_lanes = tl.maximum(m_lanes, tl.load(z_row + cols, mask=cols < V, other=float("-inf")))
    m = tl.max(m_lanes, axis=0)

    if temperature == 0.0:
        best_lanes = tl.full((BLOCK,), V, tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=3):
            cols = start + offs
            x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            best_lanes = tl.minimum(best_lanes, tl.where((x == m) & (cols < V), cols, V))
        best = tl.min(best_lanes, axis=0).to(tl.int64)
        token = tl.where(forced >= 0, forced, best)
        tl.store(token_ptr + row, token)
        tl.store(token_lp_ptr + row, tl.where(token == best, 0.0, float("-inf")))
        if WRITE_LOGPROBS:
            for start in tl.range(0, V, BLOCK, num_stages=3):
                cols = start + offs
                tl.store(lp_ptr + row * stride_lp + cols, tl.where(cols == best, 0.0, float("-inf")), mask=cols < V)
    else:
        top_k = tl.load(top_k_ptr + row).to(tl.int64)
        limit_p = tl.load(top_p_ptr + row)
        log_min_p = tl.load(log_min_p_ptr + row)
        # Defaults keep everything: the lowest key with no tie limit.
        t_k = tl.full((), -2147483648, tl.int32)
        n_k = tl.full((), V, tl.int64)
        t_p = tl.full((), -2147483648, tl.int32)
        mass_p = tl.zeros((), dtype=tl.int64)
        if TRUNCATE:
            lse = _fixed_lse(z_row, m, temperature, 0.0, t_k, n_k, t_p, mass_p, limit_p, log_min_p, V, BLOCK, False)
            if (top_k < V) | (limit_p < 2147483648):
                # The fixed-point masses do not change during the search: compute them once into the row's
                # scratch (uint32 bits in int32 storage; fᵢ <= 2^31) so each search pass only streams z and f.
                f_row = scratch_ptr + row * stride_scratch
                for start in tl.range(0, V, BLOCK, num_stages=3):
                    cols = start + offs
                    x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
                    p = tl.minimum(tl.exp(tl.math.div_rn(x - m, temperature) - lse), 1.0)
                    f = tl.floor(p * 2147483648.0).to(tl.int64)
                    tl.store(f_row + cols, f.to(tl.uint32).to(tl.int32, bitcast=True), mask=cols < V)
                tl.debug_barrier()  # the search passes may read elements other threads wrote
                lo_k = tl.full((), -2147483648, tl.int64)
                hi_k = tl.full((), 2147483647, tl.int64)
                lo_p = lo_k
                hi_p = hi_k
                for _ in range(32):
                    mid_k = (lo_k + hi_k) >> 1
                    mid_p = (lo_p + hi_p) >> 1
                    count = tl.zeros((BLOCK,), dtype=tl.int32)
                    mass = tl.zeros((BLOCK,), dtype=tl.int64)
                    for start in tl.range(0, V, BLOCK, num_stages=3):
                        cols = start + offs
                        x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
                        key = _keys(x).to(tl.int64)
                        f = _load_mass(f_row, cols, V)
                        count += ((key > mid_k) & (cols < V)).to(tl.int32)
                        mass += tl.where((key > mid_p) & (cols < V), f, 0)
                    ok_k = tl.sum(count, axis=0).to(tl.int64) < top_k
                    ok_p = tl.sum(mass, axis=0) <= limit_p
                    hi_k = tl.where(ok_k, mid_k, hi_k)
                    lo_k = tl.where(ok_k, lo_k, mid_k + 1)
                    hi_p = tl.where(ok_p, mid_p, hi_p)
                    lo_p = tl.where(ok_p, lo_p, mid_p + 1)
                t_k = lo_k.to(tl.int32)
                t_p = lo_p.to(tl.int32)
                count = tl.zeros((BLOCK,), dtype=tl.int32)
                mass_lanes = tl.zeros((BLOCK,), dtype=tl.int64)
                for start in tl.range(0, V, BLOCK, num_stages=3):
                    cols = start + offs
                    x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
                    key = _keys(x)
                    f = _load_mass(f_row, cols, V)
                    count += ((key > t_k) & (cols < V)).to(tl.int32)
                    mass_lanes += tl.where((key > t_p) & (cols < V), f, 0)
                n_k = top_k - tl.sum(count, axis=0).to(tl.int64)
                mass_p = tl.sum(mass_lanes, axis=0)
        else:
            lse = tl.zeros((), dtype=tl.float32)
        lse_kept = _fixed_lse(z_row, m, temperature, lse, t_k, n_k, t_p, mass_p, limit_p, log_min_p, V, BLOCK, TRUNCATE)
        bits = _sample_bits(tl.load(seed_ptr + row), tl.load(position_ptr + row), STREAM_OFFSET)
        # Total fixed-point mass first, so r can be drawn before the CDF walk.
        total_lanes = tl.zeros((BLOCK,), dtype=tl.int64)
        seen_k = tl.zeros((), dtype=tl.int64)
        seen_p = tl.zeros((), dtype=tl.int64)
        for start in tl.range(0, V, BLOCK, num_stages=3):
            cols = start + offs
            x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            s = tl.math.div_rn(x - m, temperature)
            kept = cols < V
            if TRUNCATE:
                kept, seen_k, seen_p = _kept(x, s, kept, t_k, n_k, t_p, mass_p, limit_p, log_min_p, seen_k, seen_p, lse)
            f = tl.where(kept, tl.floor(tl.minimum(tl.exp(s - lse_kept), 1.0) * 2147483648.0).to(tl.int64), 0)
            total_lanes += f
        total = tl.maximum(tl.sum(total_lanes, axis=0), 1)
        uniform = (bits >> 10).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
        r = tl.minimum(tl.floor(uniform * total.to(tl.float64)).to(tl.int64), total - 1)
        cdf = tl.zeros((), dtype=tl.int64)
        hit_lanes = tl.full((BLOCK,), V, tl.int32)
        forced_lanes = tl.full((BLOCK,), float("-inf"), tl.float32)
        seen_k = tl.zeros((), dtype=tl.int64)
        seen_p = tl.zeros((), dtype=tl.int64)
        for start in tl.range(0, V, BLOCK, num_stages=3):
            cols = start + offs
            x = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            s = tl.math.div_rn(x - m, temperature)
            kept = cols < V
            if TRUNCATE:
                kept, seen_k, seen_p = _kept(x, s, kept, t_k, n_k, t_p, mass_p, limit_p, log_min_p, seen_k, seen_p, lse)
            lp = tl.where(kept, s - lse_kept, float("-inf"))
            f = tl.where(kept, tl.floor(tl.minimum(tl.exp(lp), 1.0) * 2147483648.0).to(tl.int64), 0)
            inclusive = cdf + tl.cumsum(f, axis=0)
            # The CDF only grows, so the sampled column is the lowest column anywhere with CDF > r.
            hit_lanes = tl.minimum(hit_lanes, tl.where((inclusive > r) & (cols < V), cols, V))
            forced_lanes = tl.maximum(forced_lanes, tl.where(cols == forced, lp, float("-inf")))
            cdf = tl.max(inclusive, axis=0)
            if WRITE_LOGPROBS:
                tl.store(lp_ptr + row * stride_lp + cols, lp, mask=cols < V)
        token = tl.min(hit_lanes, axis=0).to(tl.int64)
        # The sampled column is kept by construction; recompute its log-prob exactly as in the pass.
        token_lp = tl.math.div_rn(tl.load(z_row + token) - m, temperature) - lse_kept
        tl.store(token_ptr + row, tl.where(forced >= 0, forced, token))
        tl.store(token_lp_ptr + row, tl.where(forced >= 0, tl.max(forced_lanes, axis=0), token_lp))


def fused_sample(
    z: torch.Tensor, batch: SamplingBatch, write_logprobs: bool, max_block: int = MAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Samples every row of pre-processed logits (`masking.preprocess_logits`) in one kernel launch.

    The random draw of each row is `seeds.random_bits(seed, position, RandomStream.SAMPLE)`, computed in the kernel.

    Args:
        z: float32 [B, V], contiguous rows, at least one finite value per row.
        batch: the step's sampling batch (temperature, top_k, top_p_threshold, log_min_p, forced_token_ids).
        write_logprobs: also return the processed log-probs.
        max_block: largest number of columns a program handles at once (a power of two).

    Returns:
        (token ids int64 [B] with golden tokens applied, their processed log-probs float32 [B] (unclamped),
        processed log-probs float32 [B, V] or None).
    """
    if z.device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(f"the Triton sampler needs CUDA tensors (or TRITON_INTERPRET=1), got z on {z.device}")
    if z.dtype != torch.float32 or z.stride(-1) != 1:
        raise ValueError(f"z must be float32 with unit column stride, got {z.dtype} strides {z.stride()}")
    num_rows, vocab = z.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=z.device)
    token_logprobs = torch.empty(num_rows, dtype=torch.float32, device=z.device)
    logprobs = torch.empty_like(z) if write_logprobs else None
    if num_rows == 0:
        return tokens, token_logprobs, logprobs
    block = min(triton.next_power_of_2(vocab), max_block)
    out = logprobs if logprobs is not None else z
    # Per-row fixed-point masses for the threshold search, only needed when some row truncates.
    scratch = torch.empty(z.shape if batch.needs_truncation else (1, 1), dtype=torch.int32, device=z.device)
    _fused_sample_kernel[(num_rows,)](
        z,
        z.stride(0),
        batch.temperature,
        batch.top_k,
        batch.top_p_threshold,
        batch.log_min_p,
        batch.seeds,
        batch.positions,
        batch.forced_token_ids,
        tokens,
        token_logprobs,
        out,
        out.stride(0),
        scratch,
        scratch.stride(0),
        vocab,
        BLOCK=block,
        TRUNCATE=batch.needs_truncation,
        WRITE_LOGPROBS=write_logprobs,
        STREAM_OFFSET=stream_offset(RandomStream.SAMPLE),
        num_warps=8 if block >= 2048 else 4,
    )
    return tokens, token_logprobs, logprobs
