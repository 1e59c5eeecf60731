"""Hazard "cuBLAS workspace freed after capture": CudaBackend.capture drops torch's cached
cuBLAS workspaces right before every ``capture_begin`` (so each capture allocates the ones
it uses in the pool, including one a warmup between two captures created in the general
pool), and again when the lifecycle ends its captures or a capture aborts (so eager work
never uses a pool block). CPU check of the order with a fake graph; the fault it prevents is
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
    return b


def test_capture_allocates_its_own_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    b = _backend(monkeypatch, log)
    out = b.capture(lambda: log.append("body") or 7, pool=None, error_mode="global", label=4).result
    assert out == 7
    assert log == ["drop", "begin", "body", "end"]


def test_every_capture_of_a_ladder_drops_the_workspaces_before_it_begins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only the first capture into a pool: the warmup of size 1 (between the captures
    of 2 and 1) may create a workspace the larger sizes never needed (cuBLASLt's, for a
    split-K GEMM), in the general pool; dropped before size 1's capture_begin, the capture
    allocates it in the pool instead of baking a block end_captures would free."""
    log: list[str] = []
    b = _backend(monkeypatch, log)
    pool = (0, 1)
    for label in (8, 4, 2):
        b.capture(lambda: None, pool=pool, error_mode="global", label=label)
    b.end_captures()
    assert log == ["drop", "begin", "end"] * 3 + ["drop"]


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
