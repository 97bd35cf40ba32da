"""The output stage on its own: text decoded once into `CompletionOutput.text`, stop strings reported as hits for
running requests and applied to requests that finished in the same step."""

from __future__ import annotations

import pytest
from llm_support import tiny_dir

from deepinfer_engine.output_processor import OutputProcessor, StopStringHit
from deepinfer_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_engine.progress import GenerateProgress
from deepinfer_engine.request import FinishReason
from deepinfer_engine.tokenizer import Tokenizer

METRICS = RequestMetrics(0, 0, 0, 1, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(tiny_dir(tmp_path_factory.mktemp("deepinfer-cache")))


def _completion(ids: list[int], reason: FinishReason) -> CompletionOutput:
    return CompletionOutput("r", (5,), tuple(ids), None, (), None, reason, None, None, METRICS)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [t for t in tokenizer.encode(text) if t != tokenizer.bos_token_id]


def _stop_index(tokenizer: Tokenizer, ids: list[int], stop: str) -> int:
    """Tokens needed before the decoded text holds `stop`."""
    return next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))


def test_text_is_decoded_once_into_the_completion(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello world, again")
    processor = OutputProcessor(tokenizer)
    processor.add("r", 3, "prompt", (), 0.0)
    progress = GenerateProgress(1, enabled=False)
    finished, hits = processor.process([RequestOutput("r", tuple(ids[:2]), None, 2)], progress)
    assert finished == [] and hits == []
    last = RequestOutput(
        "r", tuple(ids[2:]), None, len(ids), FinishReason.LENGTH, _completion(ids, FinishReason.LENGTH)
    )
    ((index, output),) = processor.process([last], progress)[0]
    assert index == 3 and output.text == tokenizer.decode(ids) and output.finish_reason is FinishReason.LENGTH


def test_a_stop_string_of_a_running_request_is_a_hit(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello world, again")
    n = _stop_index(tokenizer, ids, "wor")
    processor = OutputProcessor(tokenizer)
    processor.add("r", 0, None, ("wor",), 0.0)
    finished, hits = processor.process([RequestOutput("r", tuple(ids), None, len(ids))], GenerateProgress(1, False))
    assert finished == [] and hits == [StopStringHit("r", "wor", n)]


def test_a_stop_string_in_the_last_step_of_a_finished_request_ends_it_with_stop(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello world, again")
    n = _stop_index(tokenizer, ids, "wor")
    processor = OutputProcessor(tokenizer)
    processor.add("r", 0, None, ("wor",), 0.0)
    last = RequestOutput("r", tuple(ids), None, len(ids), FinishReason.LENGTH, _completion(ids, FinishReason.LENGTH))
    finished, hits = processor.process([last], GenerateProgress(1, False))
    ((_, output),) = finished
    assert hits == []
    assert output.finish_reason is FinishReason.STOP and output.stop_reason == "wor"
    assert output.token_ids == tuple(ids[:n]) and output.text == tokenizer.decode(ids[:n]).split("wor")[0]
