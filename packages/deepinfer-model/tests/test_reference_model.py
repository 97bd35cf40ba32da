"""End-to-end checks of the single-file reference model on random stored-format checkpoints.

Covers: the tiny preset forward (finite O(1) logits, determinism, causality, ``model.`` prefix handling, exactly the
catalogued tensors being read), the attention visibility sets of the model-attention §12 worked example, the
non-shifted mHC and FP8 compressed-KV variants, and the DSpark draft forward and heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import pytest
import torch

from deepinfer_model import reference as ref
from deepinfer_model.config import ModelConfig, load_preset
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue

# ---- random checkpoints in stored formats (model-core §5, §6; catalogue order) --------------------------------------


def _scale_tensor(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fp8_block(shape: tuple[int, int], std: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = shape
    blocks = (math.ceil(rows / 32), math.ceil(cols / 32))
    exponents = math.floor(math.log2(std)) - 4 + torch.randint(0, 2, blocks, generator=g)
    unit = ref.ue8m0_to_float(_scale_tensor(exponents)).repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)
    codes = (torch.randn(shape, generator=g) * std / unit[:, :cols]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, _scale_tensor(exponents)


def _fp8_rows(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = shape
    exponents = -4 + torch.randint(0, 2, (rows, cols // 32), generator=g)
    unit = ref.ue8m0_to_float(_scale_tensor(exponents)).repeat_interleave(32, 1)
    return (torch.randn(shape, generator=g) / unit).clamp(-448, 448).to(torch.float8_e4m3fn), _scale_tensor(exponents)


def _mxfp4(logical: tuple[int, int], std: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = logical
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int64)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    exponents = round(math.log2(std / 2.9)) + torch.randint(0, 2, (rows, cols // 32), generator=g)
    return packed, _scale_tensor(exponents)


def _hc_base(name: str, hc_mult: int, layer: int) -> torch.Tensor:
    """Initial values of model-core §10.12 (read-mix favours stream ``layer mod m``, comb near identity)."""
    m = hc_mult
    if name.endswith("hc_head_base"):
        base = torch.full((m,), -3.0)
        base[layer % m] = 3.0
        return base
    pre = torch.full((m,), -3.0)
    pre[layer % m] = 3.0
    comb = torch.full((m, m), -3.0).fill_diagonal_(3.0)
    return torch.cat([pre, torch.zeros(m), comb.flatten()])


def random_checkpoint(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random text-model tensors of every catalogue entry (vision tower left out), in their stored formats."""
    g = torch.Generator().manual_seed(seed)
    text = config.text
    out: dict[str, torch.Tensor] = {}
    for entry in build_catalogue(config):
        name = entry.name
        if name.startswith(("vision.", "aligner.")) or entry.format is TensorFormat.SCALE:
            continue
        stem = name.removesuffix(".weight")
        layer = int(name.split(".")[1]) if name.startswith(("layers.", "mtp.")) else text.num_hidden_layers
        fmt, shape = entry.format, entry.shape
        if fmt is TensorFormat.FP8_BLOCK:
            out[name], out[f"{stem}.scale"] = _fp8_block(entry.logical_shape, shape[1] ** -0.5, g)  # type: ignore[arg-type]
        elif fmt is TensorFormat.FP8_ROW:
            out[name], out[f"{stem}.scale"] = _fp8_rows(shape, g)  # type: ignore[arg-type]
        elif fmt is TensorFormat.MXFP4:
            logical = entry.logical_shape
            out[name], out[f"{stem}.scale"] = _mxfp4(logical, logical[1] ** -0.5, g)  # type: ignore[arg-type]
        elif fmt is TensorFormat.F32:
            if name.endswith("_base"):
                out[name] = _hc_base(name, text.hc_mult, layer)
            elif name.endswith("_fn"):
                out[name] = torch.randn(shape, generator=g) * 0.05
            elif name.endswith("_scale"):
                out[name] = torch.full(shape, 0.1)
            else:  # attention sinks and router biases
                out[name] = torch.randn(shape, generator=g) * 0.5
        elif name.endswith(("norm.weight", "q_weight", "k_weight")):
            out[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        elif len(shape) == 1 or name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
            out[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
        else:
            out[name] = (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
    return out


def tiny_vocabulary(config: ModelConfig) -> ref.EngramVocabulary:
    """A compressed vocabulary with collisions: token ``t`` has key ``t mod 700`` (pad stays its own key)."""
    return ref.EngramVocabulary.from_keys([f"k{t % 700}" for t in range(config.text.vocab_size)], pad_token_id=2)


class RecordingWeights(Mapping[str, torch.Tensor]):
    """A read-only weight mapping that remembers which names the forward looked up."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Iterator[None]:
    """Tiny matrices run fastest on one thread; the test machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return load_preset("tiny")


@pytest.fixture(scope="module")
def tiny_weights(tiny: ModelConfig) -> dict[str, torch.Tensor]:
    return random_checkpoint(tiny, seed=1)


@pytest.fixture(scope="module")
def tiny_tokens(tiny: ModelConfig) -> torch.Tensor:
    return torch.randint(0, tiny.text.vocab_size, (80,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def tiny_output(tiny, tiny_weights, tiny_tokens) -> ref.ReferenceOutput:
    return ref.reference_forward_full(tiny, tiny_weights, tiny_tokens, tiny_vocabulary(tiny))


# ---- tiny preset ----------------------------------------------------------------------------------------------------


def test_tiny_forward_gives_finite_order_one_logits(tiny, tiny_output, tiny_tokens):
    logits = tiny_output.logits
    assert logits.shape == (tiny_tokens.shape[0], tiny.text.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.05 < logits.std().item() < 20.0
    assert tiny_output.hidden.dtype == torch.bfloat16
    assert tiny_output.target_features.shape == (80, tiny.text.dspark_num_targets * tiny.text.hidden_size)


def test_tiny_forward_exercises_sparse_selection(tiny, tiny_output):
    text = tiny.text
    compressed = [layer for layer in range(text.num_hidden_layers) if text.compress_ratios[layer] > 0]
    assert sorted(tiny_output.selected_rows) == compressed
    for layer in compressed:
        rows = tiny_output.selected_rows[layer]
        klen = (torch.arange(80) + 1) // text.compress_ratios[layer]
        count = (rows >= 0).sum(-1)
        assert torch.equal(count, klen.clamp(max=text.index_topk)), layer
        assert bool((rows < klen[:, None]).all()), layer  # never a row the query cannot see yet


def test_tiny_forward_is_deterministic(tiny, tiny_weights, tiny_tokens, tiny_output):
    again = ref.reference_forward(tiny, tiny_weights, tiny_tokens, tiny_vocabulary(tiny))
    assert torch.equal(again, tiny_output.logits)


def test_tiny_forward_is_causal(tiny, tiny_weights, tiny_tokens, tiny_output):
    changed = tiny_tokens.clone()
    changed[50] = (changed[50] + 1) % tiny.text.vocab_size
    logits = ref.reference_forward(tiny, tiny_weights, changed, tiny_vocabulary(tiny))
    assert torch.equal(logits[:50], tiny_output.logits[:50])
    assert not torch.equal(logits[50], tiny_output.logits[50])


def test_model_prefix_is_accepted_and_duplicates_rejected(tiny, tiny_weights, tiny_tokens, tiny_output):
    prefixed = {f"model.{name}": tensor for name, tensor in tiny_weights.items()}
    logits = ref.reference_forward(tiny, prefixed, tiny_tokens[:20], tiny_vocabulary(tiny))
    assert torch.equal(logits, tiny_output.logits[:20])
    with pytest.raises(ValueError, match="both with and without"):
        ref.reference_forward(tiny, {**tiny_weights, **prefixed}, tiny_tokens[:4], tiny_vocabulary(tiny))


def test_forward_reads_exactly_the_catalogued_text_tensors(tiny, tiny_weights, tiny_tokens, tiny_output):
    recorder = RecordingWeights(tiny_weights)
    ref.reference_forward(tiny, recorder, tiny_tokens[:24], tiny_vocabulary(tiny))
    hidden = ref.reference_dspark_forward(tiny, recorder, tiny_output.target_features[:24], 5).hidden
    ref.reference_dspark_heads(tiny, recorder, hidden, torch.tensor([5, 6, 7, 8]))
    # Routed experts are read only when some token selects them.
    unused = {name for name in tiny_weights if name not in recorder.read and ".ffn.experts." not in name}
    # Image vectors and the image-token router bias belong to the multimodal path only.
    expected_unused = {"image_start", "image_end", "image_newline"} | {n for n in tiny_weights if n.endswith("bias_vl")}
    assert unused == expected_unused


def test_bad_token_ids_are_rejected(tiny, tiny_weights):
    with pytest.raises(ValueError, match="outside the text vocabulary"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, tiny.text.vocab_size]), tiny_vocabulary(tiny))
    with pytest.raises(TypeError, match="int64"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, 2], dtype=torch.int32), tiny_vocabulary(tiny))
    with pytest.raises(ValueError, match="engram_vocabulary"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, 2]))
