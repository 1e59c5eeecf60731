"""A lazy size's first call is its warmup (issue 41), on the CPU (RecordingBackend): it runs
the step eagerly on the caller's own rows at the padded size under the warmup rules and
returns that result (equal to eager at the padded size, bit for bit); the next call
captures with no eager forward; declared state is written once per call; rows the step
writes go back to the caller; a first call that raises leaves nothing behind; the watch
for undeclared writes runs there, once. GPU half: ``tests/gpu/test_lazy_first_call_gpu.py``."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.errors import GraphGuardError
from graphguard.phase import Phase

SIZES = [1, 2, 4, 8, 16]
FILL = -7.0


class Step(torch.nn.Module):
    """``x @ w + 1`` over rows, writing row ``i``'s sum into ``kv[i]`` (declared state,
    like a KV cache) and counting its forwards in ``calls``; records, per forward, the
    phase, the batch, whether auxiliary overlap was allowed and whether it was a first
    call, and the rows it saw past the caller's (the padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("kv", torch.zeros(16))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.seen: list[tuple[str, int, bool, bool]] = []
        self.rows: list[torch.Tensor] = []
        self.raise_first: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        self.seen.append(
            (phase.current_phase().value, n, phase.overlap_allowed(), phase.is_first_call())
        )
        self.rows.append(x.detach().clone())
        self.kv[:n] = x.sum(1)
        self.calls.add_(1)
        if self.raise_first is not None and phase.is_first_call():
            exc, self.raise_first = self.raise_first, None
            raise exc
        return x @ self.w + 1


def make(step: Step | None = None, **kw: Any) -> tuple[gg.GraphRunner, Step, gg.RecordingBackend]:
    step = step or Step()
    be = kw.pop("backend", None) or gg.RecordingBackend()
    kw.setdefault("state", [step.kv, step.calls])
    kw.setdefault("lazy", True)
    r = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=SIZES, fill_values=FILL, backend=be, progress=False, **kw
    )
    r.capture()
    step.seen.clear()
    step.rows.clear()
    be.events.clear()
    return r, step, be


def names(be: gg.RecordingBackend) -> list[str]:
    return [e[0] for e in be.events]


def padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` with fill rows up to ``size``: what the padded replay computes on."""
    return torch.cat([x, torch.full((size - x.shape[0], 8), FILL)])


def test_the_first_call_is_the_warmup_on_the_callers_rows_and_equals_eager_padded() -> None:
    r, step, be = make()
    x = torch.randn(3, 8)
    y = r(x)
    # Equal to eager at the padded size, bit for bit (the padded replay's contract).
    assert torch.equal(y, (padded(x, 4) @ step.w + 1)[:3])
    torch.testing.assert_close(y, x @ step.w + 1)
    # One forward, at the padded size, in phase WARMUP, aux overlap off, a first call:
    # on the caller's rows, the padding at its fill value; then a synchronize.
    assert step.seen == [("warmup", 4, False, True)]
    assert torch.equal(step.rows[0], padded(x, 4))
    assert names(be) == ["synchronize"] and r.captured_sizes == ()
    st = r.stats()
    row = st.size(4)
    assert (row.status, row.warmup_calls, row.replays) == ("warmed", 1, 0)
    assert st.eager_reasons == {"first call: the size's warmup": 1} and st.calls == 1
    assert "pending (first call: its warmup; then captured)" in st.table()


def test_the_next_call_captures_without_an_eager_forward_and_replays() -> None:
    r, step, be = make()
    x = torch.randn(3, 8)
    r(x)
    step.seen.clear()
    be.events.clear()
    y = r(x)
    torch.testing.assert_close(y, x @ step.w + 1)
    assert "capture_begin" in names(be) and r.captured_sizes == (4,)
    # The emulated capture runs the body once (CAPTURE) and its replay once (SERVING):
    # no WARMUP forward, and no first call.
    assert [s[0] for s in step.seen] == ["capture", "serving"]
    row = r.stats().size(4)
    assert (row.status, row.prewarmed, row.warmups, row.phases_ms["warmup"]) == (
        "captured",
        True,
        0,
        0.0,
    )
    be.events.clear()
    r(torch.randn(4, 8))
    assert names(be) == ["replay"]


def test_declared_state_is_written_once_per_call_as_eagerly() -> None:
    """The first call's writes are the request's (nothing snapshotted or restored); the
    capture's are undone; every replay writes once: after each call the state is what
    the same calls would leave eagerly at the padded size."""
    r, step, _ = make()
    twin = Step()
    twin.load_state_dict(step.state_dict())
    for i, x in enumerate([torch.randn(3, 8), torch.randn(3, 8), torch.randn(4, 8)]):
        r(x)
        twin(padded(x, 4))
        assert int(step.calls) == i + 1 == int(twin.calls)
        assert torch.equal(step.kv, twin.kv), i


def test_rows_the_step_writes_go_back_to_the_callers_inputs() -> None:
    def writes(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    r = gg.GraphRunner(
        writes, (torch.zeros(2, 8),), sizes=SIZES, lazy=True, state=[],
        backend=gg.RecordingBackend(), progress=False,
    )  # fmt: skip
    r.capture()
    for _ in range(3):  # the first call, the capture, a replay
        x = torch.randn(3, 8)
        want = x * 2
        y = r(x)
        assert torch.equal(x, want) and torch.equal(y, want + 1)


def test_a_first_call_that_raises_propagates_and_leaves_nothing_behind() -> None:
    r, step, _ = make(lazy=gg.Lazy(capture_now=[16]))
    twice = torch.randn(16, 8)
    r(twice)  # size 16 replays (captured at the stage)
    step.raise_first = RuntimeError("the request's own error")
    with pytest.raises(RuntimeError, match="the request's own error"):
        r(torch.randn(3, 8))
    st = r.stats()
    assert (st.size(4).status, st.size(4).warmup_calls) == ("pending", 0)
    assert r.captured_sizes == (16,)
    # The static rows the failed call left are refilled before the next replay.
    torch.testing.assert_close(r(twice[:9]), twice[:9] @ step.w + 1)
    # Size 4's next call is its first call again, then it is captured.
    step.seen.clear()
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert step.seen == [("warmup", 4, False, True)]
    r(x)
    assert r.captured_sizes == (4, 16)
    # An interrupt too.
    step.raise_first = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        r(torch.randn(7, 8))
    assert r.stats().size(8).status == "pending"
    assert r.lazy and r._lazy is not None and r._lazy.capturing is None


def test_with_no_state_declared_the_first_call_is_the_watched_warmup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The write watch runs around the first call (the capture's first warmup, which it
    stands for, would have run it), once: the capture after it watches nothing."""
    step = Step()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r, _, _ = make(step, state=None)
        x = torch.randn(3, 8)
        r(x)
        warned = [m for m in caplog.messages if "wrote tensors outside the static inputs" in m]
        assert len(warned) == 1 and "kv" in warned[0] and "calls" in warned[0]
        r(x)
    warned = [m for m in caplog.messages if "wrote tensors outside the static inputs" in m]
    assert len(warned) == 1
    assert r.stats().size(4).prewarmed and r.captured_sizes == (4,)


def test_warmup_iters_zero_and_warm_shapes_capture_on_the_first_call() -> None:
    for kw in (
        {"options": gg.CaptureOptions(warmup_iters=0)},
        {"lazy": gg.Lazy(warm_shapes=True)},
    ):
        r, step, be = make(**kw)
        x = torch.randn(3, 8)
        torch.testing.assert_close(r(x), x @ step.w + 1)
        assert "capture_begin" in names(be) and r.captured_sizes == (4,), kw
        assert r.stats().size(4).warmup_calls == 0


@pytest.mark.parametrize("now", [16, 4])
def test_warm_shapes_warms_a_capture_now_size_once_at_the_stage(now: int) -> None:
    """The stage's forward at a ``capture_now`` size (the probe's at 16, ``warm_shapes``'
    at 4) is that size's first warmup at ``capture()``, as it is for a size captured later:
    it ran twice eagerly."""
    step = Step()
    r = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=SIZES, backend=gg.RecordingBackend(), progress=False,
        state=[step.kv, step.calls], lazy=gg.Lazy(capture_now=[now], warm_shapes=True),
    )  # fmt: skip
    r.capture()
    at_now = [p for p, n, _, _ in step.seen if n == now]
    assert at_now == ["warmup", "capture"], step.seen
    assert r.captured_sizes == (now,)
    assert r.report is not None and r.report.sizes[0].prewarmed
    assert r.stats().size(now).warmups == 0


def test_a_second_thread_is_refused_during_a_first_call() -> None:
    caught: list[BaseException] = []
    r: Any = None

    class Racing(Step):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if phase.is_first_call() and not caught:

                def other() -> None:
                    try:
                        r(torch.randn(1, 8))
                    except BaseException as exc:
                        caught.append(exc)

                t = threading.Thread(target=other, name="second")
                t.start()
                t.join()
            return super().forward(x)

    r, step, _ = make(Racing())
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert len(caught) == 1 and isinstance(caught[0], GraphGuardError)
    assert "'second'" in str(caught[0]) and "running the first call of size 4" in str(caught[0])


def test_a_piecewise_runner_and_the_dispatcher_warm_on_the_first_call() -> None:
    torch._dynamo.reset()
    lib = torch.library.Library("ggfirst", "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    lib.impl("mix", lambda x: x * 2, "CPU")
    lib.impl("mix", lambda x: torch.empty_like(x), "Meta")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ggfirst.mix(x + 1) - 1

    be = gg.RecordingBackend()
    pw = gg.PiecewiseRunner(
        fn, (torch.zeros(2, 4),), split_ops=["ggfirst::mix"], sizes=[2, 4, 8], lazy=True,
        backend=be, progress=False, state=[],
    )  # fmt: skip
    pw.capture()
    be.events.clear()
    x = torch.randn(3, 4)
    torch.testing.assert_close(pw(x), fn(x))
    assert "capture_begin" not in names(be) and pw.stats().size(4).warmup_calls == 1
    torch.testing.assert_close(pw(x), fn(x))
    assert pw.captured_sizes == (4,) and pw.compile_count == 1
    step = Step()
    d = gg.build_dispatcher(
        step, (torch.zeros(2, 8),), mode="full", max_tokens=8, lazy=True,
        state=[step.kv, step.calls], progress=False, backend_factory=gg.RecordingBackend,
    )  # fmt: skip
    d.capture()
    x = torch.randn(3, 8)
    torch.testing.assert_close(d(gg.BatchKey.decode(3), x), x @ step.w + 1)
    assert d.stats()["full"].size(4).status == "warmed"


def test_phase_is_first_call_only_inside_a_first_call() -> None:
    assert not phase.is_first_call()
    with phase.enter(Phase.WARMUP, owner="test"):
        assert not phase.is_first_call()
    with phase.enter(Phase.WARMUP, owner="test", first_call=True):
        assert phase.is_first_call() and not phase.overlap_allowed()
