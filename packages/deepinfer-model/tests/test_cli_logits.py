"""``deepinfer-model logits``: one full forward written to safetensors, checked against the reference; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from deepinfer_model import reference as ref
from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.cli import main, parse_token_ids
from deepinfer_model.config import load_preset
from deepinfer_model.loading.load import load_checkpoint_dir

TOKEN_IDS = [0, 17, 250, 3, 999, 42, 42, 7, 512, 1, 88, 640, 5, 19, 300, 2, 1023, 64, 9, 100]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(load_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=5)


def _reference(directory: Path, precision: ref.Precision) -> torch.Tensor:
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = ref.engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    ids = torch.tensor(TOKEN_IDS)
    return ref.reference_forward(checkpoint.config, checkpoint.tensors, ids, vocabulary, precision=precision)


def _run(tiny_dir: Path, out: Path, dtype: str, capsys: pytest.CaptureFixture[str]) -> torch.Tensor:
    ids = ",".join(map(str, TOKEN_IDS))
    assert main(["logits", "--model", str(tiny_dir), "--token-ids", ids, "--out", str(out), "--dtype", dtype]) == 0
    assert f"wrote {out}: logits [20, 1024] float32" in capsys.readouterr().out
    tensors = load_file(str(out))
    assert list(tensors) == ["logits"]
    assert tensors["logits"].dtype == torch.float32 and tensors["logits"].shape == (len(TOKEN_IDS), 1024)
    return tensors["logits"]


def test_float32_logits_match_the_reference(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logits = _run(tiny_dir, tmp_path / "fp32.safetensors", "float32", capsys)
    expected = _reference(tiny_dir, "fp32")
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_bfloat16_runs_exact_mode(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logits = _run(tiny_dir, tmp_path / "exact.safetensors", "bfloat16", capsys)
    expected = _reference(tiny_dir, "exact")
    # Exact mode agrees with the exact-precision oracle up to rounding flips (see test_parity).
    assert (logits[:8] - expected[:8]).abs().max() <= 1e-3 * expected.abs().max()
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=-1).mean() > 0.98
    assert not torch.allclose(logits, _reference(tiny_dir, "fp32"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ("1,2,x", "error: --token-ids '1,2,x': 'x' is not an integer (expected comma-separated ids, e.g. 1,2,3)\n"),
        ("1,1024", "error: token id 1024 at index 1 is outside the vocabulary [0, 1024)\n"),
        ("-1", "error: token id -1 at index 0 is outside the vocabulary [0, 1024)\n"),
    ],
)
def test_bad_token_ids_are_one_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], token_ids: str, message: str
) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["logits", "--model", str(tiny_dir), "--token-ids", token_ids, "--out", str(out)]) == 2
    assert capsys.readouterr().err == message
    assert not out.exists()


def test_missing_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["logits", "--model", str(missing), "--token-ids", "1,2", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: checkpoint directory {missing} does not exist or is not a directory\n"


def test_missing_output_directory_is_one_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "logits.safetensors"
    assert main(["logits", "--model", str(tiny_dir), "--token-ids", "1,2", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --out {str(out)!r}: directory {str(out.parent)!r} does not exist\n"


def test_parse_token_ids() -> None:
    assert parse_token_ids("1, 2,3") == [1, 2, 3]


def test_rms_reports_o1_activations_for_every_block(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The writer's magnitudes (docs/model.md, "Checkpoint writer") are chosen so the trunk stays O(1) layer by layer.
    assert main(["rms", "--model", str(tiny_dir), "--num-tokens", "48", "--seed", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("layer")]
    values = [float(line.split(":")[1]) for line in lines]
    assert len(values) == load_preset("tiny").text.num_hidden_layers
    assert all(0.1 < value < 10.0 for value in values), values


def test_rms_rejects_an_empty_prompt(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rms", "--model", str(tiny_dir), "--num-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --num-tokens must be >= 1, got 0"
