"""The layered model on CUDA with the device kernel backend: parity with the CPU reference (FP32 mode within 1e-4;
exact mode close, since GPU summation order can flip roundings) and incremental decode on the device."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_model, tiny_vocab, tiny_weights

from deepinfer_model import reference as ref
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to_cuda(batch: ForwardBatch) -> ForwardBatch:
    tensors = {
        name: getattr(batch, name).cuda()
        for name in ("input_ids", "positions", "cu_query_lens", "context_lens", "block_table", "state_slots")
    }
    prefix = None if batch.engram_prefix_ids is None else batch.engram_prefix_ids.cuda()
    return ForwardBatch(
        **tensors,
        engram_prefix_ids=prefix,
        max_query_len=batch.max_query_len,
        max_context_len=batch.max_context_len,
    )


@pytest.fixture(scope="module", autouse=True)
def _cpu_built_weights() -> Iterator[None]:
    """Generate the random checkpoint with the PyTorch reference kernels (the writer quantizes CPU tensors, which the
    nvidia backend refuses), then let the model run with the auto-detected device backend."""
    from deepinfer_kernels import _registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_ACCELERATOR", "cpu")
        _registry.reset()
        tiny_weights()
    _registry.reset()
    yield
    _registry.reset()


@pytest.fixture(autouse=True)
def _highest_precision_matmul() -> Iterator[None]:
    # FP32 parity needs true FP32 GEMMs (no TF32) on the device; restored afterwards.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize(
    ("mode", "precision", "tolerance"), [(ComputeMode.FP32, "fp32", 1e-4), (ComputeMode.EXACT, "exact", None)]
)
def test_cuda_forward_matches_cpu_reference(
    mode: ComputeMode, precision: ref.Precision, tolerance: float | None
) -> None:
    ids = prompt(100, seed=14)
    model = tiny_model(mode).cuda()
    state = model.allocate_state(block_size=16, num_blocks=7, num_state_slots=1, device="cuda")
    table = torch.arange(7, dtype=torch.int32)[None, :]
    with torch.no_grad():
        logits = model(_to_cuda(ForwardBatch.for_requests([ids.tolist()], [0], table, [0])), state).cpu()
    config = tiny_config()
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    expected = ref.reference_forward(config, tiny_weights(), ids, vocabulary, precision=precision)
    assert torch.isfinite(logits).all()
    if tolerance is not None:
        assert (logits - expected).abs().max() <= tolerance * expected.abs().max()
    else:
        # Exact mode: another summation order may flip a BF16/FP8 rounding or a router near-tie, which then grows.
        # On an H200 the first rows agree to 1e-3 and the mean row cosine is 0.997.
        cosine = torch.nn.functional.cosine_similarity(logits, expected, dim=-1)
        assert cosine.mean() > 0.98
        assert (logits[:16] - expected[:16]).abs().max() <= 1e-3 * expected.abs().max()


def test_cuda_incremental_decode_matches_full_prefill() -> None:
    ids = prompt(72, seed=15)
    model = tiny_model(ComputeMode.FP32).cuda()
    table = torch.arange(10, dtype=torch.int32)[None, :]

    def run(bounds: list[int]) -> torch.Tensor:
        state = model.allocate_state(block_size=8, num_blocks=10, num_state_slots=1, device="cuda")
        outs = []
        with torch.no_grad():
            for start, end in itertools.pairwise(bounds):
                before = ids[max(0, start - 2) : start].tolist()
                prefix = torch.tensor([[-1] * (2 - len(before)) + before])
                batch = ForwardBatch.for_requests([ids[start:end].tolist()], [start], table, [0], prefix)
                outs.append(model(_to_cuda(batch), state).cpu())
        return torch.cat(outs)

    full = run([0, 72])
    incremental = run([0, 31, 66, *range(67, 73)])
    assert (incremental - full).abs().max() <= 1e-4 * full.abs().max()


def test_engram_on_cuda_feeds_its_stored_rows_to_the_fp8_gemm() -> None:
    """CUDA Engram (exact mode): ``wkv`` reads the gathered table rows as their FP8 copy, and the stream update equals
    the CPU path (dequantized rows × kept dequantized weight) within BF16 rounding: the same exact products summed in
    FP32 in another order can round a key or value to the neighbouring BF16 number."""
    model = tiny_model(ComputeMode.EXACT)
    engram = next(block.engram for block in model.layers if block.engram is not None)
    generator = torch.Generator().manual_seed(5)
    tokens, hc, hidden = 9, engram.hc_mult, engram.hidden
    trunk = torch.randn(tokens, hc, hidden, generator=generator).to(torch.bfloat16)
    vocab = tiny_vocab()
    rows = torch.randint(0, vocab.num_compressed, (tokens, engram.max_ngram), generator=generator)
    active = torch.ones(tokens, dtype=torch.bool)
    active[3] = False
    on_cpu = engram(trunk, engram.project(rows, vocab), active)
    engram = engram.cuda()
    assert engram.wkv.runs_on_fp8_copy()
    on_cuda = engram(trunk.cuda(), engram.project(rows.cuda(), vocab.to("cuda")), active.cuda()).cpu()
    assert torch.equal(on_cuda[3], trunk[3])
    torch.testing.assert_close(on_cuda.float(), on_cpu.float(), rtol=2.0**-7, atol=2.0**-7 * on_cpu.abs().max().item())
