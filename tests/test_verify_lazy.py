"""verify() on a lazy runner with no graph says the real state (issue 29): nothing
captured yet (a size's first call is its warmup, the next captures it: call the runner
first), or every size's capture failed (see runner.stats()); never "released, call
capture() again"."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.errors import GraphGuardError


def _lazy(sizes: list[int]) -> tuple[gg.GraphRunner, gg.RecordingBackend]:
    be = gg.RecordingBackend()
    lin = torch.nn.Linear(8, 8)
    r = gg.GraphRunner(
        lin, (torch.zeros(2, 8),), sizes=sizes, lazy=True, backend=be, progress=False
    )
    return r, be


def _why(r: gg.GraphRunner) -> str:
    with pytest.raises(GraphGuardError) as info:
        gg.verify(r)
    return str(info.value)


def test_a_lazy_runner_with_no_size_captured_yet_says_call_it_first():
    r, _ = _lazy([1, 2, 4])
    with torch.no_grad():
        r.capture()
    assert r.lazy and r.serving and r.captured_sizes == ()
    msg = _why(r)
    assert "lazy: no size captured yet" in msg
    assert "the next captures it; call the runner (or capture_for(n)) first" in msg
    assert "released" not in msg and "call capture() again" not in msg
    with torch.no_grad():
        r(torch.randn(3, 8))  # size 4's first call, its warmup: still nothing to verify
        assert "lazy: no size captured yet" in _why(r)
        r(torch.randn(3, 8))  # captures size 4
        assert gg.verify(r).ok and r.captured_sizes == (4,)


def test_a_lazy_runner_whose_every_size_failed_points_at_stats():
    r, be = _lazy([1, 2, 4])
    be.fail_on.update({1, 2, 4})
    with torch.no_grad():
        r.capture()
        for n in (1, 1, 2, 2, 3, 3):
            r(torch.randn(n, 8))  # each size warmed, tried, each capture fails: eager
    assert [s.status for s in r.stats().sizes] == ["failed"] * 3
    msg = _why(r)
    assert "every size's capture failed ([1, 2, 4]): see runner.stats()" in msg
    assert "released" not in msg and "call capture() again" not in msg
    assert "lazy: no size captured yet" not in msg


def test_some_failed_and_some_untried_says_both():
    r, be = _lazy([1, 2, 4])
    be.fail_on.add(1)
    with torch.no_grad():
        r.capture()
        r(torch.randn(1, 8))
        r(torch.randn(1, 8))
    msg = _why(r)
    assert "lazy: no size captured yet" in msg
    assert "sizes [1] failed to capture (see runner.stats()), [2, 4] not tried yet" in msg


def test_before_capture_and_after_release_keep_their_own_words():
    r, _ = _lazy([1, 2])
    assert "capture() has not run yet" in _why(r)
    with torch.no_grad():
        r.capture()
        r(torch.randn(2, 8))
    r.release()
    assert "were released (release()); call capture() again" in _why(r)
