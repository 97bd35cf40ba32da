import pytest

from deepinfer_engine.request import FinishReason, Request, RequestStatus, StopCriteria


def make(prompt=(5, 6, 7)):
    return Request("r", list(prompt), StopCriteria(max_tokens=3, eos_token_id=1))


def test_new_request_state():
    request = make()
    assert request.status is RequestStatus.WAITING
    assert request.num_computed_tokens == 0
    assert request.num_prompt_tokens == request.num_tokens == 3
    assert request.num_output_tokens == 0
    assert request.last_token_id == 7
    assert request.finish_reason is None and not request.is_finished


def test_tokens_accumulate():
    request = make()
    request.append_output_token(9, -0.5)
    request.append_output_token(10, -1.5)
    assert request.prompt_token_ids == [5, 6, 7]
    assert request.output_token_ids == [9, 10]
    assert request.output_logprobs == [-0.5, -1.5]
    assert request.token_ids(2, 4) == [7, 9]
    assert request.num_tokens == 5 and request.last_token_id == 10
    # Accessors return copies.
    request.prompt_token_ids.append(0)
    assert request.num_prompt_tokens == 3 and request.num_tokens == 5


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="prompt must not be empty"):
        make(prompt=())


def test_stop_criteria_validation():
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        StopCriteria(max_tokens=0)


def test_lifecycle_with_preemption():
    request = make()
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.PREEMPTED)
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ((), RequestStatus.PREEMPTED),  # a waiting request never ran
        ((RequestStatus.RUNNING,), RequestStatus.WAITING),
        ((RequestStatus.RUNNING,), RequestStatus.FINISHED_IGNORED),  # ignored only before running
        ((RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED), RequestStatus.RUNNING),  # finished is final
        ((RequestStatus.FINISHED_ABORTED,), RequestStatus.FINISHED_STOPPED),
        ((RequestStatus.RUNNING, RequestStatus.PREEMPTED), RequestStatus.PREEMPTED),
    ],
)
def test_illegal_transitions(path, bad):
    request = make()
    for status in path:
        request.set_status(status)
    with pytest.raises(ValueError, match="illegal status change"):
        request.set_status(bad)


def test_error_status_carries_message():
    request = make()
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.FINISHED_ERROR, "runner failed")
    assert request.error_message == "runner failed"
    assert request.finish_reason is FinishReason.ERROR


def test_error_message_needs_error_status():
    request = make()
    with pytest.raises(ValueError, match="needs an error status"):
        request.set_status(RequestStatus.FINISHED_ABORTED, "why")


def test_finish_reason_strings_match_runtime_spec():
    expected = {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH_CAPPED: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_IGNORED: "prompt_length_exceeded",
        RequestStatus.FINISHED_PREEMPTED: "insufficient_system_resource",
        RequestStatus.FINISHED_STRUCTURED_OUTPUT_FAILED: "xgrammar runtime errors or timeout",
        RequestStatus.FINISHED_ERROR: "error",
    }
    for status in RequestStatus:
        reason = status.finish_reason
        assert status.is_finished == (status in expected)
        assert (reason.value if reason else None) == expected.get(status)
