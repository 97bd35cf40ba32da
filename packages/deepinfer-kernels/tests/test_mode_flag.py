"""The kernels modes switched for a block of code (``mode_flag.ModeFlag``): off by default, on inside the block,
switched off for an inner block, restored after each, and each mode independent of the others."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import copy_context

import pytest

from deepinfer_kernels.branch_streams import branch_streams, branch_streams_requested
from deepinfer_kernels.dependent_launch import dependent_launches, dependent_launches_requested
from deepinfer_kernels.mode_flag import ModeFlag
from deepinfer_kernels.vendor_attention import vendor_attention, vendor_attention_requested

Scope = Callable[..., AbstractContextManager[None]]
MODES: list[tuple[Scope, Callable[[], bool]]] = [
    (dependent_launches, dependent_launches_requested),
    (branch_streams, branch_streams_requested),
    (vendor_attention, vendor_attention_requested),
]


@pytest.mark.parametrize(
    ("scope", "requested"), MODES, ids=["dependent_launches", "branch_streams", "vendor_attention"]
)
def test_each_mode_nests_is_off_by_default_and_leaves_the_others_alone(
    scope: Scope, requested: Callable[[], bool]
) -> None:
    others = [r for _, r in MODES if r is not requested]
    assert not requested()
    with scope():
        assert requested()
        assert not any(r() for r in others)
        with scope(False):
            assert not requested()
        assert requested()
    assert not requested()


def test_a_mode_is_restored_after_an_exception_and_belongs_to_its_context() -> None:
    flag = ModeFlag("test_flag")
    with pytest.raises(RuntimeError), flag.scope():
        raise RuntimeError("inside")
    assert not flag.requested()
    with flag.scope():
        assert not copy_context().run(lambda: ModeFlag("test_flag").requested())  # another flag of the same name
        assert copy_context().run(flag.requested)
