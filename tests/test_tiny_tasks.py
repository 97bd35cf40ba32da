"""The synthetic tasks of the built-in checkpoint (tools/tiny_tasks.py): answers are right, the held-out split never
reaches training, generation is deterministic, and the shipped held-out files are what the generator makes."""

from __future__ import annotations

import datetime
import itertools
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import tiny_tasks  # noqa: E402


def _check_answer(sample: tiny_tasks.Sample) -> None:
    prompt, answer = sample.prompt, sample.answer
    assert "\n" not in prompt + answer
    if sample.task == "add":
        a, b = prompt.removesuffix("=").split("+")
        assert answer == str(int(a) + int(b))
    elif sample.task == "count":
        start, stop = prompt.removeprefix("count ").removesuffix(":").split(" to ")
        assert answer.split() == [str(i) for i in range(int(start), int(stop) + 1)]
    elif sample.task == "copy":
        assert prompt == f"copy {answer}:"
    elif sample.task == "date" and prompt.startswith("day after "):
        day = datetime.date.fromisoformat(prompt.removeprefix("day after ").removesuffix(":"))
        assert answer == (day + datetime.timedelta(days=1)).isoformat()
    elif sample.task == "date":
        day = datetime.date.fromisoformat(prompt.removeprefix("date ").removesuffix(" in words:"))
        assert answer == day.strftime("%-d %B %Y")
    elif sample.task == "json":
        record = json.loads(answer)
        fields = dict(item.split("=") for item in prompt.removeprefix("json ").removesuffix(":").split())
        assert record == {k: int(v) if k == "age" else v for k, v in fields.items()}
    else:
        assert sample.task == "fact"
        country = next(c for c in tiny_tasks.CAPITALS if c in prompt or c in answer)
        assert tiny_tasks.CAPITALS[country] in prompt + answer


def test_every_generated_answer_is_right() -> None:
    samples = tiny_tasks.training_samples(random.Random(3))
    for sample in itertools.islice(samples, 3000):
        _check_answer(sample)
    for sample in tiny_tasks.held_out_samples(seed=5, per_task=30):
        _check_answer(sample)


def test_training_never_yields_a_held_out_prompt() -> None:
    held_out = {s.prompt for s in tiny_tasks.held_out_samples(seed=0)}
    assert held_out
    for document in itertools.islice(tiny_tasks.training_documents(random.Random(0)), 5_000):
        for sample in document:
            assert sample.prompt not in held_out
            assert not tiny_tasks.is_held_out(sample)


def test_generation_is_deterministic_from_the_seed() -> None:
    def first(seed: int) -> list[list[tiny_tasks.Sample]]:
        return list(itertools.islice(tiny_tasks.training_documents(random.Random(seed)), 200))

    assert first(1) == first(1)
    assert first(1) != first(2)
    assert tiny_tasks.held_out_samples(seed=4) == tiny_tasks.held_out_samples(seed=4)


@pytest.mark.parametrize("task", tiny_tasks.TASKS)
def test_held_out_set_covers_every_task(task: str) -> None:
    count = sum(s.task == task for s in tiny_tasks.held_out_samples(seed=0))
    assert count >= 20


def test_shipped_held_out_files_are_the_generated_ones() -> None:
    lines = (ROOT / "benchmarks" / "data" / "tiny_heldout.jsonl").read_text(encoding="utf-8").splitlines()
    expected = [tiny_tasks.held_out_record(s) for s in tiny_tasks.held_out_samples(seed=0)]
    assert [json.loads(line) for line in lines] == expected
    for record in expected:
        assert ("schema" in record) == (record["task"] == "json")
    text = (ROOT / "benchmarks" / "data" / "tiny_text.txt").read_text(encoding="utf-8")
    assert text == tiny_tasks.held_out_text(seed=0)


def test_held_out_facts_are_known_facts_in_phrasings_seen_for_other_countries() -> None:
    """Each country keeps eight of its ten phrasings in training, among them both directions of the fact; every
    held-out phrasing is a training phrasing for other countries."""
    held_out = tiny_tasks.HELD_OUT_FACT_PROMPTS
    assert len(held_out) == tiny_tasks.HELD_OUT_FACT_PHRASINGS * len(tiny_tasks.CAPITALS)
    trained_templates: set[int] = set()
    for country, capital in tiny_tasks.CAPITALS.items():
        prompts = [p.format(country=country, capital=capital) for p, _ in tiny_tasks.FACT_TEMPLATES]
        trained = [i for i, p in enumerate(prompts) if p not in held_out]
        assert len(trained) == len(prompts) - tiny_tasks.HELD_OUT_FACT_PHRASINGS
        answers = {tiny_tasks.FACT_TEMPLATES[i][1] for i in trained}
        assert answers == {" {capital}.", " {country}."}
        trained_templates.update(trained)
    assert trained_templates == set(range(len(tiny_tasks.FACT_TEMPLATES)))
