"""NumPy-compatible ``default_rng(seed).integers(0, bound, size, dtype=int64)`` in pure Python.

The Engram hash multipliers (docs/design/model.md, "Hash multipliers") are defined by NumPy's generator: a
``SeedSequence`` hashes the seed into four 64-bit words, PCG64 (128-bit LCG, XSL-RR output) is seeded from them, and
bounded integers use Lemire's multiply-and-reject method. Reproduced here so the model needs no NumPy; the tests compare
against NumPy itself.
"""

from __future__ import annotations

import itertools

__all__ = ["bounded_int64s"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MASK128 = (1 << 128) - 1
# SeedSequence hashing constants.
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16
_POOL_SIZE = 4
# PCG64 128-bit LCG multiplier.
_PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341


class _HashConstant:
    """The running multiplier of SeedSequence's ``hashmix``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def hashmix(self, value: int) -> int:
        value ^= self.value
        self.value = (self.value * _MULT_A) & _MASK32
        value = (value * self.value) & _MASK32
        return value ^ (value >> _XSHIFT)


def _mix(x: int, y: int) -> int:
    result = (_MIX_MULT_L * x - _MIX_MULT_R * y) & _MASK32
    return result ^ (result >> _XSHIFT)


def _seed_words(seed: int) -> list[int]:
    """``SeedSequence(seed).generate_state(4, uint64)`` as Python ints."""
    entropy = [0] if seed == 0 else []
    while seed > 0:
        entropy.append(seed & _MASK32)
        seed >>= 32
    hash_const = _HashConstant(_INIT_A)
    pool = [hash_const.hashmix(entropy[i] if i < len(entropy) else 0) for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                pool[dst] = _mix(pool[dst], hash_const.hashmix(pool[src]))
    for src in range(_POOL_SIZE, len(entropy)):
        for dst in range(_POOL_SIZE):
            pool[dst] = _mix(pool[dst], hash_const.hashmix(entropy[src]))
    words32 = []
    mult = _INIT_B
    for value in itertools.islice(itertools.cycle(pool), 8):
        value ^= mult
        mult = (mult * _MULT_B) & _MASK32
        value = (value * mult) & _MASK32
        words32.append(value ^ (value >> _XSHIFT))
    return [words32[2 * i] | (words32[2 * i + 1] << 32) for i in range(4)]


class _Pcg64:
    """PCG64 (XSL-RR 128/64) seeded like NumPy's ``PCG64(SeedSequence(seed))``."""

    def __init__(self, seed: int) -> None:
        words = _seed_words(seed)
        initstate = (words[0] << 64) | words[1]
        initseq = (words[2] << 64) | words[3]
        self.increment = ((initseq << 1) | 1) & _MASK128
        self.state = 0
        self._step()
        self.state = (self.state + initstate) & _MASK128
        self._step()

    def _step(self) -> None:
        self.state = (self.state * _PCG_MULT + self.increment) & _MASK128

    def next64(self) -> int:
        self._step()
        high, low = self.state >> 64, self.state & _MASK64
        value, rotation = high ^ low, self.state >> 122
        return ((value >> rotation) | (value << (64 - rotation))) & _MASK64


def bounded_int64s(seed: int, bound: int, count: int) -> list[int]:
    """``numpy.random.default_rng(seed).integers(0, bound, size=count, dtype=int64)``.

    Raises:
        ValueError: ``bound`` outside ``(2^32, 2^63]`` (NumPy draws smaller ranges from 32-bit halves, which the
            Engram multipliers never need) or a negative seed.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not (1 << 32) < bound <= (1 << 63):
        raise ValueError(f"bound must be in (2^32, 2^63], got {bound}")
    rng = _Pcg64(seed)
    threshold = ((1 << 64) - bound) % bound
    values = []
    for _ in range(count):
        product = rng.next64() * bound
        while (product & _MASK64) < threshold:
            product = rng.next64() * bound
        values.append(product >> 64)
    return values
