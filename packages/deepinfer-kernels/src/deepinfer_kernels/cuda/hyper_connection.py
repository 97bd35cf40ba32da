"""Triton mHC ops: the mixes in two kernels, the read and the post in one each (docs/design/kernels.md, "mHC ops").

- Mixes, kernel 1: the mix GEMM ``fn·z`` and ``Σz²`` over fixed chunks of ``CHUNK`` columns of the flattened trunk
  ``z`` (split-K, so a batch-1 step spreads the ``fn`` read over many programs), FP32 partials per chunk; the chunk
  count depends only on ``m·H``. A call of at most ``_TOKEN_PROGRAM_MAX_TOKENS`` tokens runs ``_token_mixes_kernel``
  with one program per (token, chunk): the chunk's whole ``fn`` tile loaded at once and summed in FP32. Beyond that,
  outside the batch-invariant mode, ``_mix_logits_kernel`` takes 64 tokens a program on Hopper's ``wgmma`` (the same
  exact products, another FP32 order); the invariant mode keeps ``_token_mixes_kernel`` with a block of tokens a
  program, whose per-token sums are the same code in the same binary, so a token's partials have the same bits at
  every token count (at one token the 64-token tile took 11.7 µs a call on the H200 and ``_mixes_kernel`` after it
  6.3, profile_step-h200-scaled-invariant-adf135a.json; the per-token programs, mixes included, 9.7 µs,
  profile_step-h200-scaled-889b3fc.json).
- Mixes, kernel 2 (``_mixes_kernel``): one program per token sums the partials in chunk order, forms ``γ`` (FP64
  reciprocal square root rounded to FP32, as the reference), the logits, both sigmoids, the softmax and every Sinkhorn
  normalization on the ``m × m`` comb held in registers. A call of at most ``_TOKEN_PROGRAM_MAX_TOKENS`` tokens (in the
  batch-invariant mode, of one token) has no second launch: each token's last ``_token_mixes_kernel`` program to
  finish does this, with the same loads and arithmetic.
- Read and post: one program per (token, block of ``H``); FP32 products and sums in the reference's order.

Divisions are IEEE (``tl.div_rn``) and every kernel is compiled with ``enable_fp_fusion=False``: a multiply followed
by an add is never contracted into an FMA, so the read and the post round exactly as the reference (bitwise equal).
The mixes differ from the reference only in FP32 summation order (``Σz²`` and the mix GEMM; TF32 operands are exact,
so ``tl.dot`` in TF32 forms exact products) and in the last bits of ``exp``.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch, prefetch_rows
from deepinfer_kernels.cuda.gemm_operands import split_counters
from deepinfer_kernels.reference.hyper_connection import HC_POST_MULT

__all__ = ["hc_mixes", "hc_post", "hc_read"]

_CHUNK = 512  # columns of z per split-K program
# The mix-GEMM kernel's K step and pipeline depth: 32 columns in 4 stages took 212 against 298 µs a call at an 8K
# prefill (64 columns in 3), one H100 (thirtieth session, benchmarks/tune_mix_logits.py).
_BLOCK_K = 32
_MIX_LOGITS_STAGES = 4
# Tokens per mix-GEMM program: every program reads its chunk of fn (24 × 512 FP32) and rounds it to TF32, so 16-token
# programs read fn 512 times over at an 8K prefill (8.2 ms of it on the H200, profile_step-h200-scaled-a1d8b78.json);
# 64 tokens make it a fourth, on Hopper's wgmma (135 registers, offline sm_90). One tile for every batch: a row's bits
# do not depend on the other rows.
_BLOCK_M = 64
_BLOCK_H = 512
# Tokens up to which a call outside the batch-invariant mode takes one program per (token, chunk), which finish the
# mixes themselves (no second launch).
_TOKEN_PROGRAM_MAX_TOKENS = 16
# Tokens a program in the batch-invariant mode, at every token count: one binary, so a token's bits do not depend on
# the call. A program loads its fn tile once and keeps it in registers for its tokens: 182 registers (offline sm_90;
# 80 at one token a program), one program a multiprocessor; eight tokens each give 1,280 programs at batch 256 (not yet
# timed). The mode finishes the mixes in these programs only at one token: with blocks, the program that takes a
# block's first ticket last would take the next ones last too and finish the block's tokens one after another.
_INVARIANT_TOKENS = 8
# Splits' partials the mixes kernel loads together (unrolled, then added in split order): the compiler's own unroll by
# four left ten dependent memory round trips for the 40 splits of m·H = 20480 (about 7 µs a call at batch 1 on the
# H200, profile_step-h200-scaled-7299ced.json); eight at a time leave five. The split count is a constexpr (m·H /
# CHUNK: one a model), so the groups are unrolled too and no store lies between them: offline (sm_90) the finishing
# program issues 57 of its 160 partial loads before its first addition, where a runtime loop over the groups issued
# each group's loads after the previous group's additions.
_SPLITS_PER_LOAD: tl.constexpr = tl.constexpr(8)


@triton.jit
def _round_to_tf32(x):  # type: ignore[no-untyped-def]
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).to(tl.float32, bitcast=True)


@triton.jit
def _mix_logits_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    fn_ptr,
    part_ptr,
    sum_sq_ptr,
    n,
    width,
    rows,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TF32: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token_mask = tokens < n
    fn_rows = tl.arange(0, BLOCK_R)
    row_mask = fn_rows < rows
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    start = split * CHUNK
    for k0 in range(start, start + CHUNK, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < width
        z = tl.load(
            z_ptr + tokens[:, None].to(tl.int64) * width + cols[None, :],
            mask=token_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            fn_ptr + fn_rows[:, None] * width + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
        )
        if TF32:
            # TF32 operands make every product exact; the MMA accumulates in FP32.
            acc += tl.dot(z, tl.trans(_round_to_tf32(w)), input_precision="tf32")
        else:
            acc += tl.dot(z, tl.trans(w), input_precision="ieee")
        sum_sq += tl.sum(z * z, axis=1)
    base = split.to(tl.int64) * n + tokens
    tl.store(part_ptr + base[:, None] * BLOCK_R + fn_rows[None, :], acc, mask=token_mask[:, None])
    tl.store(sum_sq_ptr + base, sum_sq, mask=token_mask)


@triton.jit(do_not_specialize=["n", "finish"])
def _token_mixes_kernel(  # type: ignore[no-untyped-def]
    z_ptr, fn_ptr, part_ptr, sum_sq_ptr, counter_ptr, scale_ptr, base_ptr, read_ptr, write_ptr, comb_ptr, n, width,
    rows, finish, rms_eps, hc_eps, sinkhorn_iters, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
    TF32: tl.constexpr, TOKENS: tl.constexpr, M: tl.constexpr, BLOCK_MM: tl.constexpr, POST_MULT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Program (block of TOKENS tokens, split): the chunk's fn tile [BLOCK_R, CHUNK] loaded once, then for each token
    # _mix_logits_kernel's partials from FP32 sums; TF32-rounded fn values times the trunk's values are exact
    # products, as in its dot. A token's sums are the same code whatever its place and the call's token count (n and
    # finish are not specialized, so one TOKENS gives one binary). With finish, the token's last program to finish (a
    # ticket per token, as gemm_operands.finish_tile) forms its mixes from every split's partials: _mixes_kernel's
    # loads and arithmetic, so its bits, without a launch of its own. The fn tile (a weight) is asked of L2 before
    # the wait.
    split = tl.program_id(1)
    fn_rows = tl.arange(0, BLOCK_R)
    prefetch_rows(fn_ptr, fn_rows, fn_rows < rows, width, split * CHUNK, tl.minimum(split * CHUNK + CHUNK, width), PDL)
    await_inputs(PDL)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    col_mask = cols < width
    w = tl.load(
        fn_ptr + fn_rows[:, None] * width + cols[None, :], mask=(fn_rows < rows)[:, None] & col_mask[None, :], other=0.0
    )
    if TF32:
        w = _round_to_tf32(w)
    first = tl.program_id(0).to(tl.int64) * TOKENS
    for token in range(first, tl.minimum(first + TOKENS, n)):
        z = tl.load(z_ptr + token * width + cols, mask=col_mask, other=0.0).to(tl.float32)
        base = split.to(tl.int64) * n + token
        tl.store(part_ptr + base * BLOCK_R + fn_rows, tl.sum(w * z[None, :], axis=1))
        tl.store(sum_sq_ptr + base, tl.sum(z * z, axis=0))
        if finish:
            # Every thread's stores precede the ticket (taken with release semantics); the last program reads the
            # others' partials after its acquire.
            tl.debug_barrier()
            if tl.atomic_add(counter_ptr + token, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                _token_mixes(
                    token, part_ptr, sum_sq_ptr, scale_ptr, base_ptr, read_ptr, write_ptr, comb_ptr, n,
                    width.to(tl.float32), rms_eps, hc_eps, sinkhorn_iters, SPLITS, M, BLOCK_MM, BLOCK_R, POST_MULT,
                    ".cg",
                )  # fmt: skip
                tl.atomic_xchg(counter_ptr + token, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sigmoid(x):  # type: ignore[no-untyped-def]
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))


@triton.jit
def _token_mixes(  # type: ignore[no-untyped-def]
    token, part_ptr, sum_sq_ptr, scale_ptr, base_ptr, read_ptr, write_ptr, comb_ptr, n, width, rms_eps, hc_eps,
    sinkhorn_iters, SPLITS: tl.constexpr, M: tl.constexpr, BLOCK_MM: tl.constexpr, BLOCK_R: tl.constexpr,
    POST_MULT: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    # Token ``token``'s mixes from the partials of every split (``CACHE``: the partials' load cache modifier; ".cg"
    # where other programs of the same launch wrote them, as L1 is not coherent across multiprocessors).
    streams = tl.arange(0, BLOCK_MM)
    stream_mask = streams < M
    comb_mask = stream_mask[:, None] & stream_mask[None, :]
    comb_index = streams[:, None] * M + streams[None, :]
    sum_sq = 0.0
    mu_read = tl.zeros((BLOCK_MM,), dtype=tl.float32)
    mu_write = tl.zeros((BLOCK_MM,), dtype=tl.float32)
    mu_comb = tl.zeros((BLOCK_MM, BLOCK_MM), dtype=tl.float32)
    # Loads past the last split give +0.0, which changes no sum's bits (each starts at +0.0, so never holds −0.0).
    # A split's partials are the BLOCK_R values from ``row``: the offsets below ``end`` are those of real splits.
    end = SPLITS * n * BLOCK_R
    for first in tl.static_range(0, SPLITS, _SPLITS_PER_LOAD):
        for j in tl.static_range(_SPLITS_PER_LOAD):
            split_token = (first + j) * n + token
            row = split_token * BLOCK_R
            sum_sq += tl.load(sum_sq_ptr + split_token, mask=split_token < SPLITS * n, other=0.0, cache_modifier=CACHE)
            read_at, write_at, comb_at = row + streams, row + M + streams, row + 2 * M + comb_index
            mu_read += tl.load(part_ptr + read_at, mask=stream_mask & (read_at < end), other=0.0, cache_modifier=CACHE)
            mu_write += tl.load(
                part_ptr + write_at, mask=stream_mask & (write_at < end), other=0.0, cache_modifier=CACHE
            )
            mu_comb += tl.load(part_ptr + comb_at, mask=comb_mask & (comb_at < end), other=0.0, cache_modifier=CACHE)
    # γ: FP32 mean square and + eps, the reciprocal square root in FP64, rounded once to FP32.
    mean_square = tl.div_rn(sum_sq, width)
    gamma = (1.0 / tl.sqrt((mean_square + rms_eps).to(tl.float64))).to(tl.float32)
    scale_read = tl.load(scale_ptr)
    scale_write = tl.load(scale_ptr + 1)
    scale_comb = tl.load(scale_ptr + 2)
    base_read = tl.load(base_ptr + streams, mask=stream_mask, other=0.0)
    base_write = tl.load(base_ptr + M + streams, mask=stream_mask, other=0.0)
    base_comb = tl.load(base_ptr + 2 * M + comb_index, mask=comb_mask, other=0.0)
    read = _sigmoid((mu_read * gamma) * scale_read + base_read) + hc_eps
    write = _sigmoid((mu_write * gamma) * scale_write + base_write) * POST_MULT
    # Padding lanes get a finite floor (no inf − inf); their exp is 0 in real rows and they are zeroed below.
    logits = tl.where(comb_mask, (mu_comb * gamma) * scale_comb + base_comb, -1e30)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(comb_mask, tl.div_rn(e, tl.sum(e, axis=1)[:, None]) + hc_eps, 0.0)
    comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(read_ptr + token * M + streams, read, mask=stream_mask)
    tl.store(write_ptr + token * M + streams, write, mask=stream_mask)
    tl.store(comb_ptr + token * M * M + comb_index, comb, mask=comb_mask)


@triton.jit
def _mixes_kernel(  # type: ignore[no-untyped-def]
    part_ptr, sum_sq_ptr, scale_ptr, base_ptr, read_ptr, write_ptr, comb_ptr, n,
    width,  # m·H as a float
    rms_eps, hc_eps, sinkhorn_iters, SPLITS: tl.constexpr, M: tl.constexpr, BLOCK_MM: tl.constexpr,
    BLOCK_R: tl.constexpr, POST_MULT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    _token_mixes(
        tl.program_id(0).to(tl.int64), part_ptr, sum_sq_ptr, scale_ptr, base_ptr, read_ptr, write_ptr, comb_ptr, n,
        width, rms_eps, hc_eps, sinkhorn_iters, SPLITS, M, BLOCK_MM, BLOCK_R, POST_MULT, "",
    )  # fmt: skip


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    tf32: bool,
    read: torch.Tensor,
    write: torch.Tensor,
    comb: torch.Tensor,
) -> None:
    """Triton mixes (arguments as ``reference.hyper_connection.hc_mixes``; contiguous inputs)."""
    check_launchable(trunk=trunk, fn=fn, scale=scale, base=base, read=read, write=write, comb=comb)
    n, m, hidden = trunk.shape
    width, rows = m * hidden, fn.shape[0]
    splits = triton.cdiv(width, _CHUNK)
    block_r = max(16, triton.next_power_of_2(rows))
    part = torch.empty((splits, n, block_r), dtype=torch.float32, device=trunk.device)
    sum_sq = torch.empty((splits, n), dtype=torch.float32, device=trunk.device)
    constexprs = {
        "SPLITS": splits, "M": m, "BLOCK_MM": triton.next_power_of_2(m), "BLOCK_R": block_r, "POST_MULT": HC_POST_MULT
    }  # fmt: skip
    # Python floats reach the kernels as FP32 values, as the reference adds them to FP32 tensors.
    scalars = (float(rms_eps), float(hc_eps), sinkhorn_iters)
    invariant = invariant_kernels()
    if n <= _TOKEN_PROGRAM_MAX_TOKENS or invariant:
        # The invariant mode's blocks keep one binary for every call; one token a program otherwise.
        tokens = _INVARIANT_TOKENS if invariant else 1
        finish = n == 1 if invariant else True
        _token_mixes_kernel[(triton.cdiv(n, tokens), splits)](
            trunk, fn, part, sum_sq, split_counters(trunk.device, n if finish else 1), scale, base, read, write, comb,
            n, width, rows, int(finish), *scalars, CHUNK=_CHUNK, TF32=tf32, TOKENS=tokens, **constexprs, num_warps=8,
            enable_fp_fusion=False,
            **dependent_launch(trunk.device),
        )  # fmt: skip
        if finish:
            return
    else:
        _mix_logits_kernel[(triton.cdiv(n, _BLOCK_M), splits)](
            trunk, fn, part, sum_sq, n, width, rows, CHUNK=_CHUNK, BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
            TF32=tf32, enable_fp_fusion=False, num_stages=_MIX_LOGITS_STAGES,
            **dependent_launch(trunk.device),
        )  # fmt: skip
    _mixes_kernel[(n,)](
        part, sum_sq, scale, base, read, write, comb, n, float(width), *scalars, **constexprs,
        enable_fp_fusion=False,
        **dependent_launch(part.device),
    )  # fmt: skip


@triton.jit
def _read_kernel(x_ptr, mix_ptr, out_ptr, hidden, M: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    row = x_ptr + token * M * hidden + cols
    acc = tl.load(mix_ptr + token * M) * tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, M):
        acc = acc + tl.load(mix_ptr + token * M + j) * tl.load(row + j * hidden, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, to_output_dtype(acc, out_ptr), mask=mask)


def hc_read(trunk: torch.Tensor, read_mix: torch.Tensor, out: torch.Tensor) -> None:
    """Triton read (arguments as ``reference.hyper_connection.hc_read``; contiguous inputs; bitwise equal)."""
    check_launchable(trunk=trunk, read_mix=read_mix, out=out)
    n, m, hidden = trunk.shape
    block = min(_BLOCK_H, triton.next_power_of_2(hidden))
    _read_kernel[(n, triton.cdiv(hidden, block))](
        trunk, read_mix, out, hidden, M=m, BLOCK_H=block, enable_fp_fusion=False, **dependent_launch(trunk.device)
    )


@triton.jit
def _post_kernel(  # type: ignore[no-untyped-def]
    y_ptr, x_ptr, write_ptr, comb_ptr, out_ptr, hidden, M: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    y = tl.load(y_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    row = x_ptr + token * M * hidden + cols
    for o in tl.static_range(M):
        acc = tl.load(write_ptr + token * M + o) * y
        for i in tl.static_range(M):
            source = tl.load(row + i * hidden, mask=mask, other=0.0).to(tl.float32)
            acc = acc + tl.load(comb_ptr + token * M * M + i * M + o) * source
        tl.store(out_ptr + (token * M + o) * hidden + cols, to_output_dtype(acc, out_ptr), mask=mask)


def hc_post(
    output: torch.Tensor, trunk: torch.Tensor, write_mix: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> None:
    """Triton post (arguments as ``reference.hyper_connection.hc_post``; contiguous inputs; bitwise equal)."""
    check_launchable(output=output, trunk=trunk, write_mix=write_mix, comb=comb, out=out)
    n, m, hidden = trunk.shape
    block = min(_BLOCK_H, triton.next_power_of_2(hidden))
    _post_kernel[(n, triton.cdiv(hidden, block))](
        output,
        trunk,
        write_mix,
        comb,
        out,
        hidden,
        M=m,
        BLOCK_H=block,
        enable_fp_fusion=False,
        **dependent_launch(output.device),
    )
