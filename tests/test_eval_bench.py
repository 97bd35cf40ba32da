"""benchmarks/eval.py and eval_scoring.py: the scores against hand-computed values, input errors, and short runs of
the script on the built-in checkpoint (byte-stable in deterministic mode)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age"],
}
ITEMS = [
    {"task": "addition", "prompt": "12+7=", "answer": "19"},
    {"task": "addition", "prompt": "30+45=", "answer": "75"},
    {"task": "copy", "prompt": "copy: abc ->", "answer": "abc"},
    {"task": "json", "prompt": "record: Ann 3 ->", "answer": '{"name": "Ann", "age": 3}', "schema": SCHEMA},
]


@pytest.fixture
def scoring(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import eval_scoring

    return eval_scoring


@pytest.fixture
def eval_script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import importlib

    return importlib.import_module("eval")


def _write_inputs(directory: Path, lines: list[str] | None = None) -> tuple[Path, Path]:
    tasks, text = directory / "tasks.jsonl", directory / "text.txt"
    tasks.write_text("\n".join(lines if lines is not None else [json.dumps(item) for item in ITEMS]) + "\n")
    text.write_text("12+7=19\n30+45=75\ncopy: abc -> abc\n" * 3)
    return tasks, text


def test_exact_match_and_accuracy_per_task(scoring, tmp_path):
    items = scoring.load_items(_write_inputs(tmp_path)[0])
    assert scoring.is_exact_match("19", "19")
    assert not scoring.is_exact_match("19 ", "19") and not scoring.is_exact_match("Abc", "abc")
    rows = scoring.task_accuracy(items, ["19", "57", "abc", "{}"])
    assert rows == [
        {"task": "addition", "n": 2, "correct": 1, "accuracy": 0.5},
        {"task": "copy", "n": 1, "correct": 1, "accuracy": 1.0},
        {"task": "json", "n": 1, "correct": 0, "accuracy": 0.0},
    ]
    with pytest.raises(ValueError, match="4 items but 3 completions"):
        scoring.task_accuracy(items, ["19", "75", "abc"])


def test_schema_violations(scoring):
    assert scoring.schema_violations({"name": "Ann", "age": 3, "tags": []}, SCHEMA) == []
    assert scoring.schema_violations({"name": "Ann"}, SCHEMA) == ["$: missing required key 'age'"]
    # A boolean is not an integer, a float is not an integer, and nested values are checked.
    assert scoring.schema_violations({"name": "Ann", "age": True}, SCHEMA) == ["$.age: expected integer, got bool"]
    assert scoring.schema_violations({"name": 1, "age": 2.5}, SCHEMA) == [
        "$.name: expected string, got int",
        "$.age: expected integer, got float",
    ]
    assert scoring.schema_violations([1], SCHEMA) == ["$: expected object, got list"]
    closed = {**SCHEMA, "additionalProperties": False}
    assert scoring.schema_violations({"name": "Ann", "age": 3, "city": "Rome"}, SCHEMA) == []
    assert scoring.schema_violations({"name": "Ann", "age": 3, "city": "Rome"}, closed) == [
        "$: key 'city' is not allowed"
    ]
    listed = {"type": "array", "items": {"type": ["number", "null"], "enum": [1, 2.5, None]}}
    assert scoring.schema_violations([1, 2.5, None], listed) == []
    assert scoring.schema_violations([3, "x"], listed) == [
        "$[0]: 3 is not one of [1, 2.5, None]",
        "$[1]: expected number or null, got str",
    ]
    with pytest.raises(ValueError, match="unknown type 'int'"):
        scoring.schema_violations(1, {"type": "int"})


def test_perplexity_from_log_probs(scoring):
    result = scoring.perplexity([[-1.0, -2.0], [-3.0]])
    assert result == {"tokens": 3, "chunks": 2, "mean_nll": 2.0, "perplexity": math.exp(2.0)}
    assert scoring.perplexity([[math.log(0.5)] * 4])["perplexity"] == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError, match="no scored tokens"):
        scoring.perplexity([[]])
    with pytest.raises(ValueError, match="not finite"):
        scoring.perplexity([[-math.inf]])


def test_text_chunks_score_every_text_token_once(scoring):
    assert scoring.text_chunks([0, 5, 6, 7, 8, 9], 0, 3) == [[0, 5, 6], [0, 7, 8], [0, 9]]
    assert scoring.text_chunks([5, 6, 7, 8, 9], None, 3) == [[5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="cannot hold"):
        scoring.text_chunks([0, 5, 6], 0, 2)


def test_acceptance_from_counters(scoring):
    # (generated, accepted, verified): decode steps 5-1-3 = 1, none for a one-token request, 4-1-0 = 3.
    result = scoring.acceptance([(5, 3, 10), (1, 0, 0), (4, 0, 10)], nextn=5)
    assert result == {
        "nextn": 5,
        "requests": 3,
        "generated_tokens": 10,
        "decode_steps": 4,
        "verified_draft_tokens": 20,
        "accepted_draft_tokens": 3,
        "acceptance_rate": 0.15,
        "mean_accepted_per_step": 0.75,
        "mean_acceptance_length": 1.75,
    }
    assert scoring.acceptance([(1, 0, 0)], nextn=5)["mean_acceptance_length"] is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"task": "a", "prompt": "p"', r"tasks.jsonl:2: not valid JSON"),
        ('["a"]', r"tasks.jsonl:2: expected a JSON object, got list"),
        ('{"task": "a", "prompt": "p"}', r"tasks.jsonl:2: missing key 'answer'"),
        ('{"task": "a", "prompt": "p", "answer": 19}', r"tasks.jsonl:2: key 'answer' must be a string, got int"),
        ('{"task": "", "prompt": "p", "answer": "1"}', r"tasks.jsonl:2: key 'task' must be a non-empty"),
        ('{"task": "a", "prompt": "p", "answer": "1", "schema": "x"}', r"tasks.jsonl:2: key 'schema' must be"),
    ],
)
def test_bad_jsonl_line_names_line_and_key(scoring, tmp_path, line, message):
    tasks, _ = _write_inputs(tmp_path, [json.dumps(ITEMS[0]), line])
    with pytest.raises(scoring.EvalInputError, match=message):
        scoring.load_items(tasks)


def test_selection_and_missing_files(scoring, tmp_path):
    tasks, _ = _write_inputs(tmp_path)
    items = scoring.load_items(tasks)
    assert [i.prompt for i in scoring.select_items(items, None, 1)] == ["12+7=", "copy: abc ->", "record: Ann 3 ->"]
    assert [i.task for i in scoring.select_items(items, ["copy", "addition"], None)] == ["addition"] * 2 + ["copy"]
    with pytest.raises(scoring.EvalInputError, match=r"unknown task\(s\) \['dates'\].*\['addition', 'copy', 'json'\]"):
        scoring.select_items(items, ["dates"], None)
    with pytest.raises(scoring.EvalInputError, match=r"--tasks file .*nope\.jsonl' does not exist"):
        scoring.load_items(tmp_path / "nope.jsonl")


def test_script_reports_bad_input_before_loading_a_model(eval_script, tmp_path, capsys):
    tasks, text = _write_inputs(tmp_path)
    with pytest.raises(SystemExit, match=r"eval.py: error: unknown task\(s\) \['dates'\]"):
        eval_script.main(["--tasks", str(tasks), "--text", str(text), "--only", "dates"])
    with pytest.raises(SystemExit, match="--context must be >= 3"):
        eval_script.main(["--tasks", str(tasks), "--text", str(text), "--context", "2"])
    with pytest.raises(SystemExit, match=r"--text file .*missing\.txt' does not exist"):
        eval_script.main(["--tasks", str(tasks), "--text", str(tmp_path / "missing.txt")])


def test_deterministic_json_is_byte_stable(eval_script, tmp_path, capsys):
    tasks, text = _write_inputs(tmp_path)
    common = ["--tasks", str(tasks), "--text", str(text), "--device", "cpu", "--max-tokens", "4", "--nextn", "2"]
    common += ["--context", "16"]  # the text needs several prompts
    outs = [tmp_path / "first.json", tmp_path / "second.json"]
    for out in outs:
        eval_script.main([*common, "--deterministic", "--out", str(out)])
    assert outs[0].read_bytes() == outs[1].read_bytes()
    record = json.loads(outs[0].read_text())
    assert [t["task"] for t in record["tasks"]] == ["addition", "copy", "json"]
    assert record["overall"]["n"] == 4 and record["overall"]["errors"] == 0 and record["structured"]["n"] == 1
    assert record["settings"]["tasks_file"] == str(tasks) and record["settings"]["context"] == 16
    assert record["perplexity"]["chunks"] > 1 and record["perplexity"]["perplexity"] > 1
    spec = record["speculative"]
    assert spec["nextn"] == 2 and spec["requests"] == 4 and spec["outputs_differ"] == 0
    assert spec["decode_steps"] + spec["requests"] + spec["accepted_draft_tokens"] == spec["generated_tokens"]
    assert "speed" not in record and "git_commit" not in record
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("speculative (nextn 2): acceptance length")


def test_timed_run_reports_tokens_per_second(eval_script, tmp_path):
    tasks, text = _write_inputs(tmp_path)
    out = tmp_path / "timed.json"
    common = ["--tasks", str(tasks), "--text", str(text), "--device", "cpu", "--max-tokens", "2", "--nextn", "1"]
    eval_script.main(
        [*common, "--only", "addition", "--speed-prompts", "2", "--speed-batch-sizes", "1,2", "--out", str(out)]
    )
    record = json.loads(out.read_text())
    points = {(p["batch_size"], p["drafting"]): p for p in record["speed"]}
    assert sorted(points) == [(1, False), (1, True), (2, False), (2, True)]
    assert all(p["generated_tokens"] == 4 and p["tokens_per_s"] > 0 for p in points.values())
    assert sorted(record["speedup"]) == ["1", "2"] and "torch" in record
