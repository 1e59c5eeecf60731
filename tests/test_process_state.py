"""Process-wide state: one logger rule the rank filter relies on, one reset for every
registry, and the abandoned graphs of failed captures shown in the capture report."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import _unwind, backend, phase, streams
from graphguard._process import reset_process_state
from graphguard._ranks import rank_logging
from graphguard.backend import RecordingBackend
from graphguard.phase import Phase

LIBRARY = Path(__file__).resolve().parents[1] / "src" / "graphguard"
GET_LOGGER = re.compile(r"getLogger\(([^)]*)\)")


def test_every_library_module_logs_through_the_graphguard_logger() -> None:
    """A logger-level filter (the rank filter) never sees a child logger's records."""
    calls = {
        f"{path.relative_to(LIBRARY)}: getLogger({arg})"
        for path in LIBRARY.rglob("*.py")
        for arg in GET_LOGGER.findall(path.read_text())
    }
    assert calls, "the scan found no logger at all"
    assert {c for c in calls if not c.endswith('getLogger("graphguard")')} == set()


def test_the_logger_scan_sees_a_child_logger() -> None:
    assert GET_LOGGER.findall("log = logging.getLogger(__name__)") == ["__name__"]


def _unlock_line(caplog: pytest.LogCaptureFixture, rank: int) -> list[str]:
    ws = gg.Workspace("kv-scratch", "cpu")
    ws.lock()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphguard"), rank_logging(rank):
        ws.unlock(reason="recapturing")
    return [r.getMessage() for r in caplog.records if "kv-scratch" in r.getMessage()]


def test_a_workspace_unlock_line_is_silenced_on_a_rank_other_than_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _unlock_line(caplog, 1) == []


def test_a_workspace_unlock_line_is_tagged_with_the_rank_on_rank_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = _unlock_line(caplog, 0)
    assert len(lines) == 1 and lines[0].startswith("rank 0: workspace 'kv-scratch' unlocked")


class _Queryable:
    def query(self) -> bool:
        return True


def test_reset_process_state_clears_every_registry_and_the_phase() -> None:
    import graphguard.sanitizer.checks as sanitizer_runner

    kept = _Queryable()
    streams.watch_stream(kept, "side")
    aux = gg.AuxStream("rope", "cpu")
    backend._CAPTURE_STREAMS[torch.device("cuda", 7)] = object()  # type: ignore[assignment]
    _unwind._POOL_STAND_INS[(torch.device("cuda", 7), (0, 1))] = (0, 2)
    sanitizer_runner._logged_caps = True
    phase.set_serving()
    abandoned = list(_unwind._ABANDONED_GRAPHS)
    assert streams._registry
    reset_process_state()
    assert streams._registry == {}
    assert streams.known_streams() == []
    assert backend._CAPTURE_STREAMS == {}
    assert _unwind._POOL_STAND_INS == {}
    assert sanitizer_runner._logged_caps is False
    assert phase.current_phase() is Phase.EAGER
    assert abandoned == _unwind._ABANDONED_GRAPHS  # kept on purpose (freeing is unsafe)
    del aux
    streams.watch_stream(kept, "again")  # the registry still works after a reset
    assert [n for n, _ in streams.known_streams()] == ["again"]
    streams.unwatch_stream(kept)


def test_capture_report_shows_the_abandoned_graphs_of_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    W = torch.randn(4, 4)

    def step(x: torch.Tensor) -> Any:
        return x @ W

    r = gg.GraphRunner(step, (torch.zeros(1, 4),), sizes=[1, 2], backend=RecordingBackend())
    monkeypatch.setattr(_unwind, "_ABANDONED_GRAPHS", [])
    assert r.capture().abandoned_graphs == 0
    monkeypatch.setattr(_unwind, "_ABANDONED_GRAPHS", [object(), object()])
    report = r.recapture(reason="test")
    assert report.abandoned_graphs == 2
    assert "failed captures" not in report.summary()  # data, not repeated in every line
    assert report.to_dict()["abandoned_graphs"] == 2
