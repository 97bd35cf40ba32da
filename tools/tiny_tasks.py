"""Synthetic tasks of the built-in tiny checkpoint: generated text a person can check, and its held-out split.

Every sample is a prompt and an answer that follows it directly; a sample ends with a newline, so greedy generation
with stop "\\n" returns exactly the answer. Tasks (one generator each, all driven by one ``random.Random``):

    task      prompt                               answer
    --------  -----------------------------------  --------------------------------
    add       "12+7="                              "19"   (mostly two digits; some one- and three-digit operands)
    count     "count 3 to 7:"                      "3 4 5 6 7"
    copy      "copy red fox 42:"                   "red fox 42"
    date      "day after 2024-02-28:"              "2024-02-29"
              "date 2024-03-09 in words:"          "9 March 2024"
    json      "json name=Ann age=31:"              '{"name": "Ann", "age": 31}'  (sometimes a city too)
    fact      "The capital of France is"           " Paris."  (ten phrasings over one fact table)

Held-out split: a sample is held out when a hash of its prompt falls in the held-out tenth (``is_held_out``), so the
training stream never contains a held-out prompt, by construction. Facts are split differently, because a fact never
seen cannot be answered: each country has ten phrasings (six asking for the capital, four for the country), and for
every country the two phrasings whose prompts hash lowest are held out. Training therefore states every fact in eight
phrasings, including some of the same direction as each held-out one, and every phrasing for most countries; a
held-out item asks for a known fact in a phrasing the model has seen for other countries, never for this one.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

TASKS = ("add", "count", "copy", "date", "json", "fact")
HELD_OUT_PER_MILLE = 100  # a tenth of every task but facts (module docstring)
HELD_OUT_FACT_PHRASINGS = 2  # per country

WORDS = [
    "red",
    "blue",
    "green",
    "black",
    "white",
    "cat",
    "dog",
    "fox",
    "owl",
    "bee",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "tree",
    "leaf",
    "rock",
    "sand",
    "sea",
    "map",
    "key",
    "box",
    "cup",
    "pen",
    "book",
    "lamp",
    "door",
    "road",
    "ship",
    "bird",
    "fish",
    "frog",
    "king",
    "queen",
    "gold",
    "iron",
    "salt",
    "milk",
    "bread",
]
NAMES = [
    "Ann",
    "Bob",
    "Cleo",
    "Dan",
    "Eva",
    "Finn",
    "Gus",
    "Hana",
    "Ivo",
    "Jade",
    "Kai",
    "Lena",
    "Max",
    "Nora",
    "Omar",
    "Pia",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Uma",
    "Vik",
    "Wen",
    "Yara",
    "Zoe",
]
CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Norway": "Oslo",
    "Peru": "Lima",
    "Egypt": "Cairo",
    "Japan": "Tokyo",
    "India": "New Delhi",
    "Ecuador": "Quito",
    "Portugal": "Lisbon",
    "Greece": "Athens",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Chile": "Santiago",
    "Kenya": "Nairobi",
    "China": "Beijing",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Cuba": "Havana",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Hungary": "Budapest",
    "Argentina": "Buenos Aires",
    "Brazil": "Brasilia",
    "Denmark": "Copenhagen",
    "Belgium": "Brussels",
    "Ghana": "Accra",
    "Colombia": "Bogota",
    "Australia": "Canberra",
    "Morocco": "Rabat",
    "Nepal": "Kathmandu",
    "Mongolia": "Ulaanbaatar",
}
FACT_TEMPLATES = (
    ("The capital of {country} is", " {capital}."),
    ("Q: What is the capital of {country}? A:", " {capital}."),
    ("The capital city of {country} is", " {capital}."),
    ("{country} has its capital in", " {capital}."),
    ("In {country}, the government sits in", " {capital}."),
    ("capital of {country}:", " {capital}."),
    ("{capital} is the capital of", " {country}."),
    ("The city of {capital} lies in", " {country}."),
    ("Q: Which country has {capital} as its capital? A:", " {country}."),
    ("{capital} is a city in", " {country}."),
)


@dataclass(frozen=True)
class Sample:
    """One task item: greedy generation of ``prompt`` with stop "\\n" should give ``answer``."""

    task: str
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return f"{self.prompt}{self.answer}\n"


def _prompt_hash(prompt: str) -> int:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")


def _fact_prompts(country: str) -> list[str]:
    return [prompt.format(country=country, capital=CAPITALS[country]) for prompt, _ in FACT_TEMPLATES]


HELD_OUT_FACT_PROMPTS = frozenset(
    prompt
    for country in CAPITALS
    for prompt in sorted(_fact_prompts(country), key=_prompt_hash)[:HELD_OUT_FACT_PHRASINGS]
)


def is_held_out(sample: Sample) -> bool:
    """Whether ``sample`` belongs to the held-out split (see the module docstring)."""
    if sample.task == "fact":
        return sample.prompt in HELD_OUT_FACT_PROMPTS
    return _prompt_hash(sample.prompt) % 1000 < HELD_OUT_PER_MILLE


def _operand(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.15:
        return rng.randint(0, 9)
    if roll < 0.9:
        return rng.randint(10, 99)
    return rng.randint(100, 999)


def _add(rng: random.Random) -> Sample:
    a, b = _operand(rng), _operand(rng)
    return Sample("add", f"{a}+{b}=", str(a + b))


def _count(rng: random.Random) -> Sample:
    start = rng.randint(0, 95)
    stop = start + rng.randint(1, 7)
    return Sample("count", f"count {start} to {stop}:", " ".join(str(i) for i in range(start, stop + 1)))


def _copy(rng: random.Random) -> Sample:
    items = [rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 99)) for _ in range(rng.randint(1, 5))]
    text = " ".join(items)
    return Sample("copy", f"copy {text}:", text)


def _date(rng: random.Random) -> Sample:
    day = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randint(0, 365 * 30))
    if rng.random() < 0.5:
        return Sample("date", f"day after {day.isoformat()}:", (day + datetime.timedelta(days=1)).isoformat())
    return Sample("date", f"date {day.isoformat()} in words:", f"{day.day} {MONTHS[day.month - 1]} {day.year}")


def json_record_schema(fields: tuple[str, ...]) -> dict[str, Any]:
    """The JSON schema every ``json`` answer with these fields satisfies."""
    types = {"name": "string", "age": "integer", "city": "string"}
    return {
        "type": "object",
        "properties": {field: {"type": types[field]} for field in fields},
        "required": list(fields),
        "additionalProperties": False,
    }


def _json(rng: random.Random) -> Sample:
    record: dict[str, Any] = {"name": rng.choice(NAMES), "age": rng.randint(1, 99)}
    if rng.random() < 0.4:
        record["city"] = rng.choice(CITIES)
    prompt = "json " + " ".join(f"{key}={value}" for key, value in record.items()) + ":"
    return Sample("json", prompt, json.dumps(record))


def _fact(rng: random.Random) -> Sample:
    country = rng.choice(sorted(CAPITALS))
    prompt, answer = rng.choice(FACT_TEMPLATES)
    values = {"country": country, "capital": CAPITALS[country]}
    return Sample("fact", prompt.format(**values), answer.format(**values))


GENERATORS: dict[str, Callable[[random.Random], Sample]] = {
    "add": _add,
    "count": _count,
    "copy": _copy,
    "date": _date,
    "json": _json,
    "fact": _fact,
}
TASK_WEIGHTS = {"add": 6, "count": 2, "copy": 3, "date": 2, "json": 1, "fact": 3}


def training_samples(rng: random.Random) -> Iterator[Sample]:
    """An endless stream of training samples (held-out prompts skipped), tasks drawn by ``TASK_WEIGHTS``."""
    tasks = list(TASK_WEIGHTS)
    weights = [TASK_WEIGHTS[t] for t in tasks]
    while True:
        sample = GENERATORS[rng.choices(tasks, weights)[0]](rng)
        if not is_held_out(sample):
            yield sample


def training_documents(rng: random.Random, max_samples: int = 4) -> Iterator[list[Sample]]:
    """Training documents of one to ``max_samples`` samples each (a trainer prepends BOS to each document)."""
    samples = training_samples(rng)
    while True:
        yield [next(samples) for _ in range(rng.randint(1, max_samples))]


def held_out_samples(seed: int, per_task: int = 100, max_draws: int = 20_000) -> list[Sample]:
    """Up to ``per_task`` distinct held-out samples of every task (fewer when the task has fewer held-out prompts)."""
    out: list[Sample] = []
    for task in TASKS:
        rng = random.Random(f"{seed}-heldout-{task}")
        seen: set[str] = set()
        for _ in range(max_draws):
            sample = GENERATORS[task](rng)
            if sample.prompt in seen or not is_held_out(sample):
                continue
            seen.add(sample.prompt)
            out.append(sample)
            if len(seen) == per_task:
                break
    return out


def held_out_record(sample: Sample) -> dict[str, Any]:
    """The ``benchmarks/data/tiny_heldout.jsonl`` object of a sample (JSON tasks carry their answer's schema)."""
    record: dict[str, Any] = {"task": sample.task, "prompt": sample.prompt, "answer": sample.answer}
    if sample.task == "json":
        record["schema"] = json_record_schema(tuple(json.loads(sample.answer)))
    return record


def held_out_text(seed: int, num_chars: int = 4000) -> str:
    """Plain held-out text of the same kinds (for perplexity): held-out samples in a seeded order."""
    samples = held_out_samples(seed + 1, per_task=40)
    random.Random(seed).shuffle(samples)
    text = ""
    for sample in samples:
        if len(text) >= num_chars:
            break
        text += sample.text
    return text
