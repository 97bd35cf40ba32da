"""The built-in checkpoint is the default model, loads through the ordinary loader, and has learned its tasks: a
floor on greedy exact match over a slice of the held-out set (benchmarks/data/tiny_heldout.jsonl) through
`LLM.generate`, valid JSON records, and accepted DSpark drafts. The random tiny checkpoint stays reachable as
`LLM("tiny")`."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model_source import builtin_checkpoint_dir, resolve_checkpoint, tiny_checkpoint_dir
from deepinfer_model.loading.load import load_checkpoint_dir

HELD_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "tiny_heldout.jsonl"
# Floors under the shipped checkpoint's held-out exact match (docs/builtin-checkpoint.md): tasks it has learned.
FLOORS = {"date": 0.9, "json": 0.9, "count": 0.8, "copy": 0.8, "add": 0.6}
PER_TASK = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"])
ENGINE = {"device": "cpu", "max_num_seqs": 32, "block_size": 16, "num_cache_blocks": 256}


def _held_out_slice() -> list[dict[str, str]]:
    items: dict[str, list[dict[str, str]]] = defaultdict(list)
    for line in HELD_OUT.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        if item["task"] in FLOORS and len(items[item["task"]]) < PER_TASK:
            items[item["task"]].append(item)
    return [item for task in FLOORS for item in items[task]]


def test_default_model_is_the_builtin_checkpoint(tmp_path: Path) -> None:
    directory = resolve_checkpoint(None, local_model_dir=None, revision=None, cache_root=tmp_path)
    assert directory == builtin_checkpoint_dir()
    checkpoint = load_checkpoint_dir(directory)  # the ordinary strict loader: every tensor present and used
    assert checkpoint.config.text.num_nextn_predict_layers == 1
    assert sum(p.stat().st_size for p in directory.iterdir()) < 20 * 1024**2
    random_dir = resolve_checkpoint("tiny", local_model_dir=None, revision=None, cache_root=tmp_path)
    assert random_dir == tiny_checkpoint_dir(tmp_path) and random_dir.parent == tmp_path


def test_builtin_checkpoint_answers_held_out_prompts() -> None:
    items = _held_out_slice()
    llm = LLM(**ENGINE)
    outputs = llm.generate([item["prompt"] for item in items], GREEDY, use_tqdm=False)
    correct: dict[str, list[bool]] = defaultdict(list)
    for item, output in zip(items, outputs, strict=True):
        correct[item["task"]].append(output.text == item["answer"])
        if item["task"] == "json":
            assert isinstance(json.loads(output.text), dict)
    accuracy = {task: sum(v) / len(v) for task, v in correct.items()}
    assert all(accuracy[task] >= floor for task, floor in FLOORS.items()), accuracy


def test_drafts_of_the_builtin_checkpoint_are_accepted() -> None:
    items = [item for item in _held_out_slice() if item["task"] in ("date", "json")][:6]
    prompts = [item["prompt"] for item in items]
    plain = LLM(**ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    drafted = LLM(nextn=4, **ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.text for o in drafted] == [o.text for o in plain]
    verified = sum(o.metrics.num_verified_draft_tokens for o in drafted)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in drafted)
    assert verified > 0 and accepted / verified >= 0.6, (accepted, verified)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "README.md"])
def test_builtin_checkpoint_ships_its_files(name: str) -> None:
    assert (builtin_checkpoint_dir() / name).is_file()
