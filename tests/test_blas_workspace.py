"""Hazard "cuBLAS workspace freed after capture": CudaBackend.capture drops torch's cached
cuBLAS workspaces right before the first ``capture_begin`` into a pool (so that capture
allocates them in the pool, and the ladder's later captures reuse them), and again when
the lifecycle ends its captures or a capture aborts (so eager work never uses a pool
block). CPU check of the order with a fake graph; the fault it prevents is
reproduced on the GPU by tests/gpu/test_hf_gpu.py."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from graphguard import backend


class _FakeGraph:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def capture_begin(self, **_: Any) -> None:
        self.log.append("begin")

    def capture_end(self) -> None:
        self.log.append("end")


def _backend(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> backend.CudaBackend:
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: log.append("drop"), raising=False
    )
    monkeypatch.setattr(backend, "new_graph", lambda keep: _FakeGraph(log))
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    b = object.__new__(backend.CudaBackend)  # no CUDA here: only capture() is exercised
    b.device = torch.device("cuda", 0)
    b.debug_dump_dir = None
    b._stream = None  # type: ignore[assignment]
    b._workspace_pool = backend._NO_POOL
    return b


def test_capture_allocates_its_own_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    b = _backend(monkeypatch, log)
    _, out = b.capture(lambda: log.append("body") or 7, pool=None, error_mode="global", label=4)
    assert out == 7
    assert log == ["drop", "begin", "body", "end"]


def test_a_ladder_shares_one_workspace_per_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    b = _backend(monkeypatch, log)
    pool_a, pool_b = (0, 1), (0, 2)
    for label in (8, 4, 2):
        b.capture(lambda: None, pool=pool_a, error_mode="global", label=label)
    b.end_captures()
    assert log == ["drop", "begin", "end", "begin", "end", "begin", "end", "drop"]
    log.clear()
    b.capture(lambda: None, pool=pool_b, error_mode="global", label=8)
    b.capture(lambda: None, pool=pool_a, error_mode="global", label=8)
    assert log == ["drop", "begin", "end", "drop", "begin", "end"]


def test_failed_capture_drops_the_workspace_too(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    b = _backend(monkeypatch, log)

    def body() -> None:
        log.append("body")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        b.capture(body, pool=None, error_mode="global", label=4)
    assert log[:3] == ["drop", "begin", "body"]
    assert log[-1] == "drop"
