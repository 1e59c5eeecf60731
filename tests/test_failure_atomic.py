"""Failure-atomic capture: every exception kind at every lifecycle point (CPU, RecordingBackend).

After any failure: no graph is live over an unlocked arena, the process phase is SERVING
only if a graph was kept, the collector and the capture window are restored, the declared
state is as it was, and capture() (or recapture()) works and equals eager.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.backend import RecordingBackend
from graphguard.errors import (
    BusyStreamError,
    ConfigError,
    GraphCaptureError,
    GraphGuardError,
    WorkspaceLockedError,
)
from graphguard.phase import Phase

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
SIZES = (1, 2, 4, 8)

KINDS: dict[str, Callable[[], BaseException]] = {
    "Exception": lambda: RuntimeError("injected fault"),
    "KeyboardInterrupt": lambda: KeyboardInterrupt(),
    "GraphGuardError": lambda: GraphGuardError("injected graphguard error"),
    "ConfigError": lambda: ConfigError("injected config error"),
    "WorkspaceLockedError": lambda: WorkspaceLockedError(
        "injected", arena="a", requested=2, locked=1, site="here"
    ),
    "BusyStreamError": lambda: BusyStreamError("injected busy stream"),
}

# (where, size, warmup iteration): where is hook / warmup / capture / lock. The forward 0
# in phase WARMUP of sizes 8 and 4 is the output-layout probe's (graphguard.outputs), which
# notes a failure instead of raising and stands for their first lifecycle warmup: their
# one remaining warmup is forward 1. Size 2 runs both of its own (forwards 0 and 1).
POINTS: dict[str, tuple[str, int, int]] = {
    "before_capture_hook": ("hook", 0, 0),
    "warmup_first_size": ("warmup", 8, 1),
    "warmup_second_size": ("warmup", 4, 1),
    "warmup0_middle_size": ("warmup", 2, 0),
    "warmup1_middle_size": ("warmup", 2, 1),
    "capture_first_size": ("capture", 8, 0),
    "capture_middle_size": ("capture", 2, 0),
    "capture_last_size": ("capture", 1, 0),
    "lock": ("lock", 0, 0),
}


class Fault:
    """Raises ``make()`` once at the chosen point, then stays quiet (so a retry works)."""

    def __init__(self, point: str, make: Callable[[], BaseException]) -> None:
        self.where, self.size, self.iteration = POINTS[point]
        self.make = make
        self.armed = True
        self.warmups: dict[int, int] = {}

    def fire(self, where: str, size: int = 0) -> None:
        if not self.armed or where != self.where or size != self.size:
            return
        if where == "warmup":
            k = self.warmups.get(size, 0)
            self.warmups[size] = k + 1
            if k != self.iteration:
                return
        self.armed = False
        raise self.make()


class FlakyWorkspace(gg.Workspace):
    fault: Fault | None = None

    def lock(self) -> None:
        if self.fault is not None:
            self.fault.fire("lock")
        super().lock()


def build(fault: Fault) -> tuple[gg.GraphRunner, list[gg.Workspace], torch.Tensor]:
    counter = torch.zeros((), dtype=torch.long)

    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if phase.current_phase() is Phase.WARMUP:
            fault.fire("warmup", n)
        if phase.is_capturing():
            fault.fire("capture", n)
        counter.add_(1)  # device-side state the capture must give back
        return x @ W + idx[:, None].to(x.dtype)

    plain = gg.Workspace("plain", "cpu")
    flaky = FlakyWorkspace("flaky", "cpu")
    flaky.fault = fault
    r = gg.GraphRunner(
        fn,
        (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)),
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
        fill_values=(0.0, 5),
        before_capture=[lambda sizes: fault.fire("hook")],
        workspaces=[plain, flaky],
        state={"counter": counter},
        options=gg.CaptureOptions(warmup_iters=2),
    )
    return r, [plain, flaky], counter


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


def expected_kept(point: str, kind: str) -> tuple[int, ...]:
    """What a failure keeps: a per-size Exception keeps the larger sizes; the rest nothing."""
    where, size, _ = POINTS[point]
    per_size = where in ("warmup", "capture") and kind not in (
        "KeyboardInterrupt",
        "BusyStreamError",
    )
    return tuple(s for s in SIZES if s > size) if per_size else ()


def assert_consistent(r: gg.GraphRunner, arenas: list[gg.Workspace]) -> None:
    kept = r.captured_sizes
    if kept:
        assert all(ws.locked for ws in arenas), "graphs are live over an unlocked arena"
        assert phase.current_phase() is Phase.SERVING
    else:
        assert not any(ws.locked for ws in arenas), "no graph, yet an arena was locked"
        assert phase.current_phase() is Phase.EAGER
    assert phase.capture_window_owner() is None
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    events = r.backend.events  # type: ignore[attr-defined]
    begins = sum(e[0] == "capture_begin" for e in events)
    ends = sum(e[0] in ("capture_end", "capture_abort") for e in events)
    assert begins == ends, "a capture was left open"


def assert_equals_eager(r: gg.GraphRunner, fn: Any) -> None:
    for n in (1, 3, 5, 8, 2, 11):
        x, idx = batch(n, seed=n)
        torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("point", list(POINTS))
def test_failure_at_any_point_leaves_a_consistent_retryable_runner(point: str, kind: str) -> None:
    gc.unfreeze()
    fault = Fault(point, KINDS[kind])
    r, arenas, counter = build(fault)
    kept = expected_kept(point, kind)
    expected_type = (
        GraphCaptureError
        if kept
        or (
            POINTS[point][0] in ("warmup", "capture")
            and kind not in ("KeyboardInterrupt", "BusyStreamError")
        )
        else type(KINDS[kind]())
    )
    with pytest.raises(expected_type) as ei:
        r.capture()
    assert not fault.armed, "the fault never fired"
    if expected_type is GraphCaptureError:
        assert ei.value.size == POINTS[point][1]
        assert "injected" in str(ei.value) or kind == "KeyboardInterrupt"
    assert r.captured_sizes == kept
    assert int(counter) == 0, "capture changed the declared state"
    assert_consistent(r, arenas)
    if kept:
        assert_equals_eager(r, None)  # the kept graphs serve (each call bumps the counter)
        counter.zero_()
        r.recapture(reason="retry after a failed size")
    else:
        with pytest.raises(GraphGuardError, match="before capture"):
            r(*batch(2))
        r.capture()  # retry: nothing was kept, so capture() simply runs again
    assert r.captured_sizes == SIZES
    assert int(counter) == 0
    assert_consistent(r, arenas)
    assert_equals_eager(r, None)


def test_hook_failure_note_says_capture_may_be_retried() -> None:
    fault = Fault("before_capture_hook", KINDS["Exception"])
    r, _, _ = build(fault)
    with pytest.raises(RuntimeError) as ei:
        r.capture()
    assert "capture() may be called again" in "".join(getattr(ei.value, "__notes__", []))


def test_interrupt_drops_graphs_already_captured_and_logs_why(caplog: Any) -> None:
    fault = Fault("capture_middle_size", KINDS["KeyboardInterrupt"])
    r, _, _ = build(fault)
    with pytest.raises(KeyboardInterrupt):
        r.capture()
    assert r.captured_sizes == ()
    assert "dropped the 2 graph(s) it had captured ([8, 4])" in caplog.text


def test_skip_mode_with_every_size_failing_is_not_serving_and_can_capture_again() -> None:
    be = RecordingBackend()
    be.fail_on = set(SIZES)
    ws = gg.Workspace("a", "cpu")
    r = gg.GraphRunner(
        lambda x: x * 2,
        (torch.zeros(2, 3),),
        sizes=SIZES,
        backend=be,
        progress=False,
        workspaces=[ws],
        options=gg.CaptureOptions(on_capture_error="skip"),
    )
    report = r.capture()
    assert sorted(report.failed) == list(SIZES) and r.captured_sizes == ()
    assert not ws.locked and phase.current_phase() is Phase.EAGER
    x = torch.randn(3, 3)
    torch.testing.assert_close(r(x), x * 2)  # eager: capture() ran, nothing captured
    be.fail_on = set()
    r.capture()
    assert r.captured_sizes == SIZES and ws.locked


def test_after_capture_hook_failure_keeps_the_complete_capture() -> None:
    ws = gg.Workspace("a", "cpu")

    def bad_hook(sizes: Any) -> None:
        raise RuntimeError("after hook failed")

    r = gg.GraphRunner(
        lambda x: x + 1,
        (torch.zeros(2, 3),),
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
        workspaces=[ws],
        options=gg.CaptureOptions(after_capture=[bad_hook]),
    )
    with pytest.raises(RuntimeError, match="after hook failed"):
        r.capture()
    assert r.captured_sizes == SIZES and ws.locked and phase.current_phase() is Phase.SERVING
    with pytest.raises(GraphGuardError, match="recapture"):
        r.capture()


def test_shape_error_gets_no_host_sync_hint_but_a_sync_error_does() -> None:
    def shape_bug(x: torch.Tensor) -> torch.Tensor:
        if phase.is_capturing():
            return x @ torch.zeros(5, 5)  # wrong inner dimension
        return x

    def sync_bug(x: torch.Tensor) -> torch.Tensor:
        if phase.is_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x

    msgs = []
    for fn in (shape_bug, sync_bug):
        r = gg.GraphRunner(
            fn, (torch.zeros(2, 3),), sizes=(2,), backend=RecordingBackend(), progress=False
        )
        with pytest.raises(GraphCaptureError) as ei:
            r.capture()
        msgs.append(str(ei.value))
    assert "must not synchronize" not in msgs[0]
    assert "capturing size 2 failed: RuntimeError: mat1 and mat2 shapes" in msgs[0]
    assert "must not synchronize the host" in msgs[1]


def test_capture_unsafe_op_error_is_sync_related() -> None:
    from graphguard.capture import sync_related
    from graphguard.errors import CaptureUnsafeOpError

    assert sync_related(CaptureUnsafeOpError(".item() during capture"))
    assert sync_related(
        RuntimeError("CUDA error: operation not permitted when stream is capturing")
    )
    assert sync_related(RuntimeError("cudaErrorStreamCaptureInvalidated"))
    assert not sync_related(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
