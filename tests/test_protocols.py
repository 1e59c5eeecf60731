"""The protocols between modules, stated and used directly: ``GraphBackend.end_captures``,
``Workspace.buffer`` / ``Workspace.observe``, the piecewise size graph's own replay, and
the compile fields of the report filled in one place."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import GraphBackend, RecordingBackend
from graphguard.compiled import CompiledStep
from graphguard.report import CaptureReport

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


class CountingBackend(RecordingBackend):
    def __init__(self) -> None:
        super().__init__()
        self.ends = 0

    def end_captures(self) -> None:
        self.ends += 1


def step(x: torch.Tensor) -> torch.Tensor:
    return x @ W


def test_end_captures_is_part_of_the_backend_protocol_with_a_recording_no_op() -> None:
    assert "end_captures" in vars(GraphBackend)
    be = RecordingBackend()
    be.end_captures()
    assert be.events == []  # not a device event: the recorded lifecycle is unchanged


def test_the_lifecycle_ends_captures_once_per_run_and_on_abort() -> None:
    be = CountingBackend()
    r = gg.GraphRunner(step, (torch.zeros(1, 6),), sizes=[1, 2, 4], backend=be)
    r.capture()
    assert be.ends == 1

    def hook(sizes: Any) -> None:
        raise KeyboardInterrupt

    be2 = CountingBackend()
    r2 = gg.GraphRunner(
        step, (torch.zeros(1, 6),), sizes=[1, 2], backend=be2, before_capture=[hook]
    )
    with pytest.raises(KeyboardInterrupt):
        r2.capture()
    assert be2.ends == 1


def test_size_graph_replays_the_closure_it_holds_not_the_runner() -> None:
    from graphguard.piecewise.kind import _SizeGraph

    calls: list[int] = []
    g = _SizeGraph(lambda: calls.append(1), 4)
    g.replay()
    assert calls == [1] and g.size == 4
    assert not hasattr(g, "_runner")


def test_workspace_buffer_is_the_arena_and_read_only() -> None:
    ws = gg.Workspace("scratch", "cpu")
    assert ws.buffer is None
    (v,) = ws.get(((4,), torch.float32))
    assert ws.buffer is not None
    assert ws.buffer.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    with pytest.raises(AttributeError):
        ws.buffer = torch.zeros(1)  # type: ignore[misc]


def test_workspace_observe_sees_every_get_and_keeps_an_enclosing_observer() -> None:
    ws = gg.Workspace("scratch", "cpu")
    outer: list[str] = []
    inner: list[str] = []
    with ws.observe(lambda w: outer.append(w.name)) as installed:
        assert installed
        ws.get(((2,), torch.float32))
        with ws.observe(lambda w: inner.append(w.name)) as nested:
            assert not nested
            ws.get(((2,), torch.float32))
        ws.get(((2,), torch.float32))  # the outer observer survived the nested block
    ws.get(((2,), torch.float32))  # removed on exit
    assert outer == ["scratch"] * 3 and inner == []


def test_workspace_observe_is_removed_when_the_block_raises() -> None:
    ws = gg.Workspace("scratch", "cpu")
    seen: list[int] = []
    with pytest.raises(ValueError), ws.observe(lambda w: seen.append(1)):
        raise ValueError("boom")
    ws.get(((2,), torch.float32))
    assert seen == []


@pytest.mark.compile
def test_report_compile_fields_come_from_one_place() -> None:
    report = CaptureReport(mode="full", backend="cpu")
    reasons = ["x.size()[0] != 1"]
    report.set_compiles(2, reasons, 1.5)
    reasons.append("later")  # the report keeps its own copy
    assert (report.compiles, report.recompiles, report.compile_s) == (2, ["x.size()[0] != 1"], 1.5)
    cs = CompiledStep(step)
    cs.compiles, cs.compile_s, cs.recompile_reasons = 3, 0.25, ["a"]
    assert cs.fill_report(report) is report
    assert (report.compiles, report.recompiles, report.compile_s) == (3, ["a"], 0.25)
