"""benchmarks/profile_step.py: the device timeline's busy time, the host-read test of the sites pass, and a CPU
profile of one decode step of the built-in checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def profile_step(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_step

    return profile_step


def test_busy_time_counts_overlapping_kernels_once(profile_step):
    assert profile_step.busy_us([]) == 0.0
    assert profile_step.busy_us([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # disjoint: the gap is idle
    assert profile_step.busy_us([(4.0, 9.0), (0.0, 5.0)]) == 9.0  # overlapping (two streams), unsorted
    assert profile_step.busy_us([(0.0, 10.0), (2.0, 3.0), (11.0, 12.0)]) == 11.0  # nested


def test_host_reads_are_device_data_brought_to_the_host(profile_step):
    reads = profile_step.reads_device_on_host
    device, host = torch.empty(4, device="meta"), torch.empty(4)
    assert reads("aten::_local_scalar_dense", ((device,), {}), 3.0)  # .item()
    assert reads("aten::_to_copy", ((device,), {}), host)  # a copy back
    assert reads("aten::nonzero", ((device,), {}), torch.empty((2, 1), device="meta"))  # data-sized output
    assert not reads("aten::add", ((device, device), {}), device)
    assert not reads("aten::_local_scalar_dense", ((host,), {}), 3.0)  # CPU data: no device to wait for
    assert not reads("aten::nonzero", ((host,), {}), host)
    counts = torch.empty(3, dtype=torch.int64, device="meta")
    assert reads("aten::repeat_interleave", ((device, counts), {}), device)  # the count is read back
    assert not reads("aten::repeat_interleave", ((device, counts), {"output_size": 4}), device)
    assert not reads("aten::repeat_interleave", ((device, 2), {}), device)  # integer repeats
    assert reads("aten::repeat_interleave", ((counts,), {}), device)  # the repeats-only overload


def test_a_cpu_decode_profile_lists_sites_and_no_host_reads(profile_step):
    from deepinfer_engine import LLM

    llm = LLM(device="cpu", max_model_len=256, num_cache_blocks=8, max_num_seqs=2)
    try:
        point = profile_step.profile_point(llm.model, "decode", 2, 16, 1, 0, torch.device("cpu"), sites=3)
    finally:
        llm.close()
    assert point["unit"] == "aten ops" and point["launches_per_step"] > 0
    assert 0 < len(point["sites"]) <= 3 and point["host_reads"] == []
    assert "span_us_per_step" not in point


def test_device_waits_are_counted_from_sync_debug_warnings(profile_step, monkeypatch):
    """The counting, not torch's detection: the sync debug mode is a CUDA setting, recorded here instead."""
    import warnings

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    counter = profile_step._SiteCounter()
    with profile_step.device_waits(counter):
        assert modes[-1] == "warn"
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert counter.device_waits == {("<outside the packages>", "wait"): 2}
    assert modes[-1] == 0  # restored


def test_a_zero_size_is_refused_before_any_model_is_built(profile_step, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["profile_step.py", "--batches", "0"])
    with pytest.raises(SystemExit):
        profile_step.main()
    assert "sizes of at least 1" in capsys.readouterr().err


def test_the_sequence_is_the_first_steps_kernels_in_start_order(profile_step):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    # Two profiled steps of three kernels each, out of order in the trace, and a host event that is not a kernel.
    events = [
        event("norm", 3.0, 4.0),
        event("gemm", 0.0, 2.5),
        event("aten::add", 0.0, 9.0, DeviceType.CPU),
        event("norm", 13.0, 14.0),
        event("post", 4.5, 6.0),
        event("gemm", 10.0, 12.5),
        event("post", 14.5, 16.0),
    ]
    sequence = profile_step.kernel_sequence(events, steps=2)
    assert [k["name"] for k in sequence] == ["gemm", "norm", "post"]
    assert [k["us"] for k in sequence] == [2.5, 1.0, 1.5]
    assert [k["gap_us"] for k in sequence] == [0.0, 0.5, 0.5]
