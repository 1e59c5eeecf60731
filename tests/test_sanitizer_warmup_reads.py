"""The sanitizer's warmup-only host read (issue 29): a host read seen in an uncaptured
warmup but not in the capture is allowed (the graph holds only what the capture
recorded); the same read inside the capture is refused as "found during the capture".
The CPU emulation marks the capture through :mod:`graphguard.phase`
(``torch.cuda.is_current_stream_capturing()`` is always false on a CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.backend import RecordingBackend
from graphguard.errors import CaptureUnsafeOpError

SIZES = [1, 2, 4, 8]


def _make(fn, **kw):
    return gg.GraphRunner(
        fn,
        (torch.zeros(3, 6),),
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
        sanitize=True,
        **kw,
    )


W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def test_a_host_read_only_outside_the_capture_is_allowed_and_replays_like_eager(caplog):
    reads = {"warmup": 0, "capture": 0}

    def step(x: torch.Tensor) -> torch.Tensor:
        if phase.is_capturing():
            reads["capture"] += 1
        else:  # e.g. cuDNN's dropout state, set up once outside the capture
            reads["warmup"] += int(x.abs().sum().item() >= 0)
        return torch.tanh(x @ W)

    r = _make(step)
    with caplog.at_level(logging.DEBUG, logger="graphguard"):
        report = r.capture()  # no CaptureUnsafeOpError
    assert report.captured == SIZES
    assert reads["warmup"] > 0 and reads["capture"] == len(SIZES)
    names = r.backend.names()
    assert names.count("capture_end") == len(SIZES) and "capture_abort" not in names
    assert any(
        "in an uncaptured warmup of size" in m and "allowed there" in m for m in caplog.messages
    )
    for n in (1, 3, 8):
        x = torch.randn(n, 6)
        torch.testing.assert_close(r(x), step(x))


def test_the_same_read_inside_the_capture_is_refused_saying_so():
    def step(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # in every forward, the capture's included
        return x @ W * scale

    r = _make(step)
    with pytest.raises(CaptureUnsafeOpError) as info:
        r.capture()
    msg = str(info.value)
    assert "during the capture of size 8" in msg
    assert "test_sanitizer_warmup_reads.py:" in msg
    assert "reads a device value on the host" in msg
    assert r.backend.names().count("capture_abort") == 1


def test_a_read_only_inside_the_capture_is_refused():
    def step(x: torch.Tensor) -> torch.Tensor:
        if phase.is_capturing():
            return x @ W * float(x.sum().item())
        return x @ W

    with pytest.raises(CaptureUnsafeOpError, match="during the capture of size 8"):
        _make(step).capture()
