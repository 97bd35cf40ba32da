"""Counter-based randomness keyed only by (request seed, position, stream case).

Every random number the sampler and the speculative verifier use is a pure function of three keys, computed with
int64 tensor ops on the device (no `torch.Generator`, no state, no host sync):

- request seed: a 64-bit integer per request (`request_seed` derives it; stored as int64 bits in tensors);
- position: an int64 key per row, by convention the absolute index of the token the row generates;
- stream case (`RandomStream`): separates the independent draws made for the same position.

So a row's draws never depend on batch size, row order or neighbours. The hash is SplitMix64's finaliser
(`mix64`, a bijection on 64-bit words) applied in a chain: k = mix64(mix64(mix64(seed) ^ position·φ) + stream·φ'),
draw j = mix64(k + (j + 1)·φ), with φ the 64-bit golden-ratio constant. Arithmetic wraps modulo 2^64 (two's
complement int64); right shifts are made logical by masking.

API for other modules (the speculative verifier uses ACCEPT, RECOVERED and BONUS):

- `random_bits(seeds[B], positions[B], stream, num) -> int64 [B, num]`, uniform over [0, 2^63);
- `uniforms(seeds[B], positions[B], stream, num) -> float32 [B, num]`, uniform over [0, 1) on a 2^-24 grid
  (so `u < p` accepts with probability exactly p rounded to that grid; p = 1 always accepts, p = 0 never);
- `request_seed(seq_seed, ...)` on the host, to turn `SamplingParams.seq_seed` into the request seed.

The fused Triton sampler (`fused/triton_sampler.py`) computes the same hash in uint64 inside its kernel; the
fused-vs-reference tests check that both give identical draws.
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM_MUL = 0xD1B54A32D192ED03
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Domain tags keep seeds derived from seq_seed apart from seeds derived from the engine seed.
_TAG_USER = 0x5EED_0001
_TAG_ENGINE = 0x5EED_0002


class RandomStream(enum.IntEnum):
    """Stream cases: independent draws for the same (seed, position).

    SAMPLE: the normal sample of a row. RECOVERED: the resample from the rejection residual of a rejected draft.
    ACCEPT: the accept/reject uniform of a verified draft. BONUS: the sample of the row after the last accepted draft.
    DRAFT: the drafter's own samples.
    """

    SAMPLE = 0
    RECOVERED = 1
    ACCEPT = 2
    BONUS = 3
    DRAFT = 4


def _signed(value: int) -> int:
    """Two's-complement int64 view of a 64-bit word (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def request_seed(seq_seed: int | None, *, index_in_call: int, engine_seed: int, request_counter: int) -> int:
    """Derives a request's 64-bit seed (host side, once per request).

    Args:
        seq_seed: `SamplingParams.seq_seed` (already reduced modulo 2^64) or None.
        index_in_call: index of the sample among those sharing the params object in one call (k × n + sample
            index for the k-th prompt given that object); used when `seq_seed` is set.
        engine_seed: the engine's seed; used when `seq_seed` is None.
        request_counter: the engine's global request counter; used when `seq_seed` is None.

    Returns:
        The request seed in [0, 2^64).
    """
    if index_in_call < 0 or request_counter < 0:
        raise ValueError(f"index_in_call and request_counter must be >= 0, got {index_in_call}, {request_counter}")
    if seq_seed is not None:
        base, index, tag = seq_seed, index_in_call, _TAG_USER
    else:
        base, index, tag = engine_seed, request_counter, _TAG_ENGINE
    return _mix64_int(_mix64_int(_mix64_int(base) ^ tag) + index * _GOLDEN)


def seed_to_int64(seed: int) -> int:
    """Maps a seed in [0, 2^64) to the int64 with the same bits, for storage in an int64 tensor."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return _signed(seed)


def _shr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (any shape); a bijection of 64-bit words."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"seeds and positions must be int64, got {seeds.dtype} and {positions.dtype}")
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds and positions must both be [B], got {tuple(seeds.shape)} and {tuple(positions.shape)}")
    key = mix64(mix64(seeds) ^ (positions * _signed(_GOLDEN)))
    if isinstance(stream, torch.Tensor):
        return mix64(key + (stream.to(torch.int64) + 1) * _signed(_STREAM_MUL))
    # A Python scalar offset: no host-to-device copy.
    return mix64(key + _signed(stream_offset(stream)))


def stream_offset(stream: int) -> int:
    """(stream + 1)·φ' mod 2^64, the word a stream case adds to a row key (for kernels that hash in place)."""
    return ((int(stream) + 1) * _STREAM_MUL) & _MASK64


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor, num: int) -> torch.Tensor:
    """Uniform random integers in [0, 2^63), keyed by (seed, position, stream, draw index).

    Args:
        seeds: int64 [B], request seeds (bits of the uint64 seed).
        positions: int64 [B], position keys.
        stream: a `RandomStream` case, or int64 [B] with one case per row.
        num: number of draws per row (>= 1); draw j of a row never depends on `num`.

    Returns:
        int64 [B, num], non-negative.
    """
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    key = _row_keys(seeds, positions, stream)
    counter = torch.arange(1, num + 1, dtype=torch.int64, device=seeds.device) * _signed(_GOLDEN)
    return _shr(mix64(key[:, None] + counter[None, :]), 1)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor, num: int) -> torch.Tensor:
    """Uniform floats in [0, 1) on a 2^-24 grid (exact in float32), keyed like `random_bits`.

    Args:
        seeds: int64 [B], request seeds.
        positions: int64 [B], position keys.
        stream: a `RandomStream` case, or int64 [B].
        num: number of draws per row (>= 1).

    Returns:
        float32 [B, num].
    """
    top24 = random_bits(seeds, positions, stream, num) >> 39
    return top24.to(torch.float32) * (2.0**-24)
