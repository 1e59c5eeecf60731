"""The serving-time rules (docs/serving.md) on the CPU with RecordingBackend: nothing
device-wide inside an open capture (refused from inside the step, waited for from another
thread), one weight record per graph, budgets and stats that tell the truth."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.errors import GraphGuardError, WeightsMovedError

MIB = 1 << 20


class Step(torch.nn.Module):
    """``x @ w + 1``; ``inside(n)`` runs inside the capture of batch ``n`` (once)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.inside: dict[int, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        if phase.is_capturing() and n in self.inside:
            self.inside.pop(n)()
        return x @ self.w + 1


def twice(r: gg.GraphRunner, n: int) -> None:
    """Two calls at batch ``n``: its size's first call (its warmup), then its capture."""
    for _ in range(2):
        r(torch.randn(n, 8))


def lazy(step: Step, **kw: Any) -> gg.GraphRunner:
    kw.setdefault("backend", gg.RecordingBackend())
    return gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=[1, 2, 4, 8], progress=False, state=[], **kw
    )


def test_release_from_inside_the_step_during_a_lazy_capture_is_refused_and_changes_nothing() -> (
    None
):
    step = Step()
    r = lazy(step, lazy=True)
    r.capture()
    twice(r, 8)
    r(torch.randn(3, 8))  # size 4's first call
    seen: list[str] = []

    def release_inside() -> None:
        with pytest.raises(GraphGuardError, match=r"release\(\) was called from inside the step"):
            r.release()
        seen.append("refused")

    step.inside[4] = release_inside
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert seen == ["refused"]
    assert r.serving and r.captured_sizes == (4, 8)  # not released, size 4 captured
    assert r.stats().size(4).status == "captured"


@pytest.mark.parametrize("how", ["lazily", "up front"])
def test_door_capture_from_inside_the_step_is_refused_as_drop_size_is(how: str) -> None:
    """docs/serving.md: refused, not a capture nested in the open one."""
    step = Step()
    be = gg.RecordingBackend()
    r = lazy(step, lazy=True, backend=be)
    r.capture()
    r(torch.randn(3, 8))  # size 4's first call
    seen: list[str] = []

    def capture_inside() -> None:
        for call in (lambda: r.door.capture([8], how=how), lambda: r.door.drop_size(8)):
            with pytest.raises(GraphGuardError, match=r"\(\) was called from inside the step"):
                call()
        seen.append("refused")

    step.inside[4] = capture_inside
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert seen == ["refused"]
    assert r.captured_sizes == (4,)  # size 8 not captured inside size 4's capture
    assert [e[1] for e in be.events if e[0] == "capture_begin"] == [4]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([3], r"door\.capture\(sizes, how=\.\.\.\): 3 is not on the ladder; the ladder "
         r"\(runner\.sizes\) is \[1, 2, 4, 8\] \(4 sizes\).*pick sizes from runner\.sizes"),
        ([4, 5, 6], r"\[5, 6\] are not on the ladder"),
        ([4.0], r"4\.0 \(float\) is not an int"),
        (4, r"takes a list of sizes, got the int 4; pass \[4\] \(drop_size takes one size\)"),
        ("4", r"takes a list of sizes, got str '4'"),
    ],
)  # fmt: skip
def test_door_capture_refuses_what_is_not_a_list_of_ladder_sizes(sizes: Any, message: str) -> None:
    """A size off the ladder was captured and held memory, yet no batch ever replayed it
    and stats() had no row for it; an int raised a raw TypeError."""
    be = gg.RecordingBackend()
    r = lazy(Step(), lazy=True, backend=be)
    r.capture()
    with pytest.raises(gg.errors.ConfigError, match=message):
        r.door.capture(sizes, how="lazily")
    assert r.captured_sizes == () and not [e for e in be.events if e[0] == "capture_begin"]
    with pytest.raises(gg.errors.ConfigError, match=r"how must be one of \['up front', 'lazily'\]"):
        r.door.capture([4], how="eagerly")
    with pytest.raises(gg.errors.ConfigError, match=r"door\.drop_size\(size\): 3 is not on"):
        r.door.drop_size(3)


def test_door_capture_sizes_is_the_old_spelling_of_door_capture_for_one_release() -> None:
    """``graphguard.capture_sizes(n)`` is a ladder of sizes; the door's operation that
    captures some sizes now is ``door.capture``, and 0.4's name still works, warning."""
    r = lazy(Step(), lazy=True, backend=gg.RecordingBackend())
    r.capture()
    with pytest.warns(DeprecationWarning, match=r"^graphguard\.door\.capture_sizes.*door\.capture"):
        report = r.door.capture_sizes([4], how="lazily")  # type: ignore[attr-defined]
    assert [s.size for s in report.sizes] == [4] and r.captured_sizes == (4,)


def test_release_and_update_weights_from_another_thread_wait_for_the_lazy_capture() -> None:
    step = Step()
    r = lazy(step, lazy=True)
    r.capture()
    order: list[str] = []
    started, go = threading.Event(), threading.Event()

    def hold() -> None:  # inside the capture of size 4: let the other thread try now
        order.append("capture open")
        started.set()
        go.wait(5)
        order.append("capture closing")

    step.inside[4] = hold
    r(torch.randn(4, 8))  # its first call
    new_w = torch.randn(8, 8)

    def other() -> None:
        started.wait(5)
        t = threading.Thread(target=lambda: go.set())
        t.start()  # the capture may close only after this thread has called in
        r.update_weights({"w": new_w})
        order.append("update done")
        r.release()
        order.append("release done")

    t = threading.Thread(target=other)
    t.start()
    with torch.no_grad():
        r(torch.randn(4, 8))
    t.join(10)
    assert order.index("capture closing") < order.index("update done")
    assert order[-1] == "release done"
    assert not r.serving and r.captured_sizes == ()
    assert torch.equal(step.w, new_w)
    with pytest.raises(GraphGuardError, match=r"after release\(\)"):
        r(torch.randn(4, 8))


def test_a_lazy_capture_that_waited_for_a_release_does_not_bring_the_runner_back() -> None:
    step = Step()
    r = lazy(step, lazy=True)
    r.capture()
    r(torch.randn(4, 8))  # its first call: capture_for(4) then captures
    with r.door.exclusive("test"):  # another thread's release runs now; this call waits
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(r.capture_for(4)))
        t.start()
        time.sleep(0.05)
        r.release()
    t.join(5)
    assert done == [None] and not r.serving and r.captured_sizes == ()


def test_a_second_thread_is_refused_with_the_size_being_captured() -> None:
    step = Step()
    r = lazy(step, lazy=True)
    r.capture()
    errors: list[str] = []

    def call_from_another_thread() -> None:
        def other() -> None:
            try:
                r(torch.randn(1, 8))
            except GraphGuardError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=other, name="intruder")
        t.start()
        t.join(5)

    step.inside[8] = call_from_another_thread
    twice(r, 7)
    assert len(errors) == 1 and "capturing size 8 lazily" in errors[0]
    assert "'intruder'" in errors[0]


def test_a_later_capture_never_hides_an_older_graphs_stale_read() -> None:
    step = Step()
    r = lazy(step, lazy=gg.Lazy(capture_now=[8]))
    r.capture()
    old = step.w.detach().clone()
    step.w.data = torch.randn(8, 8)  # rebound: the size-8 graph still reads the old storage
    twice(r, 4)  # a lazy capture of size 4, over the new storage
    found = r.check_weights()
    assert not found.ok and found.sizes == (8,)
    assert [m.name for m in found.moved] == ["w"] and found.moved[0].sizes == (8,)
    before = step.w.detach().clone()
    with pytest.raises(WeightsMovedError, match=r"(?s)sizes \[8\].*no weight changed"):
        r.update_weights({"w": torch.zeros(8, 8)})
    assert torch.equal(step.w, before) and not torch.equal(old, before)
    r.recapture(reason="w rebound", only_moved=True)
    assert r.check_weights().ok and r.captured_sizes == (4, 8)


def pool_of(label: Any) -> tuple[int, int]:
    """Pool: 1 MiB per row of the size; driver: 2 MiB per graph."""
    return int(label) * MIB, 2 * MIB


def test_capture_now_sizes_count_against_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    step = Step()
    be = gg.RecordingBackend(graph_bytes=pool_of)
    r = lazy(step, lazy=gg.Lazy(capture_now=[8, 4], budget=12 * MIB), backend=be)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r.capture()  # 8: 8 + 2 = 10 MiB fits; 4: +0 pool (reuses 8's blocks)... +2 = 12 fits
    assert r.captured_sizes == (4, 8)
    r2 = lazy(Step(), lazy=gg.Lazy(capture_now=[8, 4], budget=9 * MIB), backend=be)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r2.capture()
    over = [m for m in caplog.messages if "over budget" in m]
    assert r2.stats().size(8).status == "over budget"
    assert over and "10.0 MiB" in over[0] and "9.0 MiB budget" in over[0]
    assert r2.door.ledger.used <= 9 * MIB + r2.door.ledger.pool_bytes  # the driver's share is back


def test_eager_calls_are_counted_under_their_real_reason() -> None:
    step = Step()

    class Fails(Step):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 8 and phase.is_capturing():
                raise RuntimeError("emulated failure capturing 8")
            return super().forward(x)

    step = Fails()
    r = lazy(step, lazy=True)
    r.capture()
    for n in (7, 7, 7, 20):
        x = torch.randn(n, 8)
        torch.testing.assert_close(r(x), x @ step.w + 1)
    reasons = r.stats().eager_reasons
    first = "first call: the size's warmup"
    assert reasons == {first: 1, "size failed": 2, "above the ladder": 1}


def test_stats_before_capture_and_after_release_say_not_captured() -> None:
    r = lazy(Step(), lazy=True)
    assert {s.status for s in r.stats().sizes} == {"not captured"}
    r.capture()
    assert {s.status for s in r.stats().sizes} == {"pending"}
    r(torch.randn(2, 8))
    r.release()
    assert {s.status for s in r.stats().sizes} == {"not captured"}


def test_the_over_budget_drop_logs_the_numbers_that_decided(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def superlinear(label: Any) -> tuple[int, int]:
        return int(label) ** 2 * MIB, MIB

    be = gg.RecordingBackend(graph_bytes=superlinear)
    r = lazy(Step(), lazy=gg.Lazy(budget=10 * MIB), backend=be)
    r.capture()
    twice(r, 2)  # 4 + 1 = 5 MiB
    r(torch.randn(4, 8))  # its first call
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r(torch.randn(4, 8))  # predicted from size 2's rows: fits; took 16 + 1: over
    over = [m for m in caplog.messages if "over budget" in m]
    assert len(over) == 1 and "dropped" in over[0]
    assert "0.0 MiB of" not in over[0] and "of a 10.0 MiB budget" in over[0]
    assert r.stats().size(4).status == "over budget"


def test_check_weights_on_a_lazy_runner_with_no_graph_yet_is_ok() -> None:
    r = lazy(Step(), lazy=True)
    with pytest.raises(GraphGuardError, match=r"before capture\(\)"):
        r.check_weights()
    r.capture()
    found = r.check_weights()
    assert found.ok and found.checked == 0


def test_lazy_warm_shapes_runs_every_ladder_size_at_the_stage() -> None:
    seen: list[tuple[str, int]] = []

    class Seen(Step):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((phase.current_phase().value, int(x.shape[0])))
            return super().forward(x)

    r = lazy(Seen(), lazy=gg.Lazy(warm_shapes=True))
    r.capture()
    assert sorted({n for p, n in seen if p == "warmup"}) == [1, 2, 4, 8]
    assert r.captured_sizes == ()  # warmed, not captured
    with pytest.raises(gg.errors.ConfigError, match="warm_shapes"):
        gg.Lazy(warm_shapes="yes")  # type: ignore[arg-type]
