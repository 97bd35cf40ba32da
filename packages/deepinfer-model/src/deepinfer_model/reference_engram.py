"""Engram hashing of the reference model: compressed vocabulary, table primes, multipliers, n-gram rows, gate.

Part of the single reference model: ``deepinfer_model.reference`` re-exports the public names and applies a layer's
Engram to the trunk (docs/design/model.md, "Engram").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, normalizers
from torch import Tensor

from deepinfer_model.config import TextConfig
from deepinfer_model.reference_formats import Precision, _inverse_rms, _numerics

__all__ = [
    "EngramVocabulary",
    "engram_gate",
    "engram_hash",
    "engram_hash_multipliers",
    "engram_ngram_rows",
    "engram_normalize",
    "engram_table_primes",
    "engram_vocabulary_from_tokenizer",
]

_ENGRAM_SPACE_SENTINEL = "\ue000"  # private-use character protecting a single-space key from Strip()


def _engram_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _ENGRAM_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_ENGRAM_SPACE_SENTINEL, " "),
        ]
    )


def engram_normalize(text: str) -> str:
    """The Engram token-text normalization (docs/design/model.md, "Compressed vocabulary")."""
    return str(_engram_normalizer().normalize_str(text))


@dataclass(frozen=True)
class EngramVocabulary:
    """Tokenizer id → compressed Engram id (docs/design/model.md, "Compressed vocabulary"), built once outside the
    forward.

    Attributes:
        old_to_new: ``[Vt]`` int64, compressed id of every tokenizer id.
        num_compressed: ``V_c``, the number of distinct keys (it sets the hash multiplier bound).
        pad_id: compressed id of the Engram pad token.
    """

    old_to_new: Tensor
    num_compressed: int
    pad_id: int

    @staticmethod
    def from_keys(keys: Sequence[str], pad_token_id: int = 2) -> EngramVocabulary:
        """Assign compressed ids in order of first appearance of each key (``keys[t]`` is token ``t``'s key)."""
        if not 0 <= pad_token_id < len(keys):
            raise ValueError(f"Engram pad token id {pad_token_id} is outside the vocabulary [0, {len(keys)})")
        first_seen: dict[str, int] = {}
        ids = [first_seen.setdefault(key, len(first_seen)) for key in keys]
        return EngramVocabulary(torch.tensor(ids, dtype=torch.int64), len(first_seen), ids[pad_token_id])


def engram_vocabulary_from_tokenizer(tokenizer: Tokenizer, pad_token_id: int = 2) -> EngramVocabulary:
    """Build the compressed Engram vocabulary from a ``tokenizers.Tokenizer`` (``tokenizer.json``).

    Args:
        tokenizer: the checkpoint's tokenizer.
        pad_token_id: tokenizer id of the Engram pad (``DEEPINFER_ENGRAM_PAD_TOKEN``, default 2).

    Raises:
        ValueError: ``<｜▁pad▁｜>`` is not token 2.
    """
    pad = tokenizer.token_to_id("<｜▁pad▁｜>")
    if pad != 2:
        raise ValueError(f"Engram requires the tokenizer to map '<｜▁pad▁｜>' to id 2, got {pad}")
    normalizer = _engram_normalizer()
    keys = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(tokenizer.id_to_token(token_id) or text)
        else:
            keys.append(normalizer.normalize_str(text) or text)
    return EngramVocabulary.from_keys(keys, pad_token_id)


def _next_prime(start: int) -> int:
    """Smallest prime strictly greater than ``start``."""
    candidate = max(start + 1, 2)
    while True:
        if candidate == 2 or (candidate % 2 and all(candidate % d for d in range(3, math.isqrt(candidate) + 1, 2))):
            return candidate
        candidate += 1


def engram_table_primes(text: TextConfig) -> list[list[int]]:
    """Prime hash-table sizes per Engram layer (order of ``engram_layer_ids``), sub-tables order-major
    (docs/design/model.md, "Table primes")."""
    max_ngram, heads, vocab = _engram_sizes(text)
    used: set[int] = set()
    tables = []
    for _ in text.engram_layer_ids:
        sizes = []
        for _order in range(2, max_ngram + 1):
            start = vocab - 1
            for _head in range(heads):
                prime = _next_prime(start)
                while prime in used:
                    prime = _next_prime(prime)
                used.add(prime)
                sizes.append(prime)
                start = prime
        tables.append(sizes)
    return tables


def _engram_sizes(text: TextConfig) -> tuple[int, int, int]:
    """``(N_g, h_e, V_e)``; raises if the Engram keys are unset."""
    sizes = (text.engram_max_ngram_size, text.engram_n_heads, text.engram_vocab_size)
    if any(value is None for value in sizes):
        raise ValueError(f"Engram layers {list(text.engram_layer_ids)} need every engram_* size key, got {sizes}")
    return sizes  # type: ignore[return-value]


# numpy's SeedSequence / PCG64 / bounded-integer algorithms, written out so the model package needs no numpy.
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_MASK128 = (1 << 128) - 1
_PCG64_MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645


def _seed_sequence_words(seed: int, num_words: int) -> list[int]:
    """``numpy.random.SeedSequence(seed).generate_state(num_words, uint32)`` (pool size 4, no spawn key)."""
    entropy = []
    value = seed
    while True:
        entropy.append(value & _MASK32)
        value >>= 32
        if value == 0:
            break
    hash_const = 0x43B0D7E5

    def hashmix(word: int) -> int:
        nonlocal hash_const
        word ^= hash_const
        hash_const = (hash_const * 0x931E8875) & _MASK32
        word = (word * hash_const) & _MASK32
        return word ^ (word >> 16)

    def mix(x: int, y: int) -> int:
        result = (0xCA01F9DD * x - 0x4973F715 * y) & _MASK32
        return result ^ (result >> 16)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    out_const = 0x8B51F9DD
    words = []
    for i in range(num_words):
        word = pool[i % 4] ^ out_const
        out_const = (out_const * 0x58F38DED) & _MASK32
        word = (word * out_const) & _MASK32
        words.append(word ^ (word >> 16))
    return words


class _Pcg64:
    """numpy's ``PCG64`` bit generator (128-bit LCG, XSL-RR output) seeded through ``SeedSequence``."""

    def __init__(self, seed: int) -> None:
        words = _seed_sequence_words(seed, 8)
        w64 = [words[2 * k] | (words[2 * k + 1] << 32) for k in range(4)]
        self._inc = (((w64[2] << 64) | w64[3]) << 1 | 1) & _MASK128
        self._state = 0
        self._step()
        self._state = (self._state + ((w64[0] << 64) | w64[1])) & _MASK128
        self._step()

    def _step(self) -> None:
        self._state = (self._state * _PCG64_MULTIPLIER + self._inc) & _MASK128

    def next_uint64(self) -> int:
        self._step()
        value = ((self._state >> 64) ^ self._state) & _MASK64
        rotation = self._state >> 122
        return ((value >> rotation) | (value << ((-rotation) & 63))) & _MASK64

    def bounded_uint64(self, bound: int) -> int:
        """Uniform integer in ``[0, bound]`` by Lemire's method (numpy's 64-bit path, ``bound > 2^32 − 1``)."""
        exclusive = bound + 1
        product = self.next_uint64() * exclusive
        if product & _MASK64 < exclusive:
            threshold = (_MASK64 - bound) % exclusive
            while product & _MASK64 < threshold:
                product = self.next_uint64() * exclusive
        return product >> 64


def engram_hash_multipliers(layer_id: int, max_ngram: int, num_compressed: int) -> list[int]:
    """Odd int64 hash multipliers of Engram layer ``ℓ`` (docs/design/model.md, "Hash multipliers").

    ``B = max(1, ⌊⌊(2^63−1)/V_c⌋/2⌋)``; ``a = 2·default_rng(10007·ℓ).integers(0, B, size=N_g) + 1``.
    """
    bound = max(1, ((2**63 - 1) // num_compressed) // 2)
    if bound == 1:
        return [1] * max_ngram
    if bound - 1 <= _MASK32:
        raise ValueError(f"compressed vocabulary size {num_compressed} is too large for the 64-bit multiplier draw")
    rng = _Pcg64(10007 * layer_id)
    return [2 * rng.bounded_uint64(bound - 1) + 1 for _ in range(max_ngram)]


def engram_ngram_rows(compressed_ids: Tensor, max_ngram: int, pad_id: int) -> Tensor:
    """Suffix n-gram id rows ``g_r = c_{p−r}`` (docs/design/model.md, "N-gram rows").

    Positions before the request start are ``pad_id``; from the first sentinel −1 (scanning ``r`` upward) every
    entry is ``pad_id``.

    Args:
        compressed_ids: ``[..., n]`` int64 compressed ids (−1 = sentinel) of one sequence or a batch of them.
        max_ngram: ``N_g``.
        pad_id: compressed pad id.

    Returns:
        ``[..., n, N_g]`` int64.
    """
    n = compressed_ids.shape[-1]
    before = torch.full((*compressed_ids.shape[:-1], max_ngram - 1), pad_id, dtype=torch.int64)
    padded = torch.cat([before, compressed_ids], dim=-1)
    rows = torch.stack([padded[..., max_ngram - 1 - r : max_ngram - 1 - r + n] for r in range(max_ngram)], dim=-1)
    hit_sentinel = torch.cumsum((rows < 0).int(), dim=-1) > 0
    return torch.where(hit_sentinel, torch.full_like(rows, pad_id), rows)


def engram_hash(rows: Tensor, multipliers: Sequence[int], primes: Sequence[int], n_heads: int) -> Tensor:
    """Table row indices of every (order, head) sub-table (docs/design/model.md, "Engram hash"), offsets included.

    Args:
        rows: ``[n, N_g]`` int64 n-gram id rows.
        multipliers: ``N_g`` odd multipliers of the layer.
        primes: ``(N_g−1)·h_e`` sub-table sizes, order-major.
        n_heads: ``h_e``.

    Returns:
        ``[n, (N_g−1)·h_e]`` int64 row indices into the layer's concatenated table.
    """
    offsets = [0]
    for p in primes[:-1]:
        offsets.append(offsets[-1] + p)
    h = rows[:, 0] * multipliers[0]
    columns = []
    for order in range(1, rows.shape[1]):
        h = h ^ (rows[:, order] * multipliers[order])
        for head in range(n_heads):
            col = (order - 1) * n_heads + head
            columns.append(torch.remainder(h, primes[col]) + offsets[col])
    return torch.stack(columns, dim=1)


def engram_gate(
    trunk: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, *, precision: Precision = "exact"
) -> Tensor:
    """Engram gate and update ``X_j ← bf16(X_j + g_j·v)`` (docs/design/model.md, "Engram lookup and gate").

    Args:
        trunk: ``[n, m, H]`` BF16 (FP32 in fp32 precision, as is ``kv``).
        kv: ``[n, m+1, H]`` BF16: one key per stream, then the shared value.
        q_weight: ``[m, H]`` BF16.
        k_weight: ``[m, H]`` BF16.
        eps: ``rms_norm_eps``.
        precision: ``"fp32"`` skips the BF16 rounding of the update.

    Returns:
        ``[n, m, H]`` BF16 (FP32 in fp32 precision).
    """
    m, hidden = q_weight.shape
    x = trunk.float()
    keys = kv[:, :m].float()
    value = kv[:, m].float()
    w = q_weight.float() * k_weight.float()
    a_x = _inverse_rms((x * x).sum(-1), hidden, eps)
    a_k = _inverse_rms((keys * keys).sum(-1), hidden, eps)
    z = (x * w * keys).sum(-1) * a_x * a_k / math.sqrt(hidden)
    gate = torch.sigmoid(torch.copysign(torch.sqrt(z.abs().clamp_min(1e-6)), z))
    return _numerics(precision).bf16(x + gate[..., None] * value[:, None, :])
