"""What a lazy capture costs, on the CPU (RecordingBackend): every millisecond of it in a
named phase or in ``other``; the garbage collector paused for all of it and restored on
every exit; and a size whose first warmup already ran (its first call, or the stage with
``Lazy(warm_shapes=True)``) captured without another eager forward, everything else of
the lifecycle kept."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase, streams
from graphguard.phase import Phase

SIZES = [1, 2, 4, 8, 16]

NAMED = (
    "budget", "wait", "plan", "sync", "reset", "snapshot", "lifecycle", "warmup", "idle_check",
    "memory_probe", "capture", "register", "end", "restore", "lock", "report", "bookkeeping",
    "settle",
)  # fmt: skip
"""The phases every lazy capture has (a warmed one adds ``sync_before_capture``)."""


class Step(torch.nn.Module):
    """``x @ w + 1`` that counts its calls (declared state) and logs each forward's phase
    and batch into ``events`` (shared with the backend: one timeline)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.events: list[tuple[Any, ...]] = []
        self.gc_enabled: list[bool] = []
        self.fail_at: int | None = None
        self.fail_in = Phase.CAPTURE  # the phase fail_at fails in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        self.events.append(("forward", phase.current_phase().value, n))
        self.gc_enabled.append(gc.isenabled())
        if self.fail_at == n and phase.current_phase() is self.fail_in:
            raise torch.OutOfMemoryError(f"emulated OOM in {self.fail_in.value} at batch {n}")
        self.calls.add_(1)
        return x @ self.w + 1


def runner(
    step: Step | None = None, *, warm: bool = False, budget: int | None = None, **kw: Any
) -> tuple[gg.GraphRunner, Step, gg.RecordingBackend]:
    step = step or Step()
    be = kw.pop("backend", None) or gg.RecordingBackend()
    be.events = step.events
    kw.setdefault("state", [step.calls])
    r = gg.GraphRunner(
        step,
        (torch.zeros(2, 8),),
        sizes=SIZES,
        progress=False,
        lazy=gg.Lazy(warm_shapes=warm, budget=budget),
        backend=be,
        **kw,
    )
    r.capture()
    del step.events[:]
    step.gc_enabled.clear()
    return r, step, be


def first_call(r: gg.GraphRunner, step: Step, n: int = 3) -> None:
    """The first call at the size ``n`` pads to (its warmup, eagerly); then forget what it
    logged, so the test sees the capture at the next call alone."""
    x = torch.randn(n, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert r.stats().size(r.door.pad_table.padded(n) or 0).status == "warmed"
    del step.events[:]
    step.gc_enabled.clear()


def timeline(events: Sequence[tuple[Any, ...]]) -> list[str]:
    return [e[0] if e[0] != "forward" else f"forward:{e[1]}:{e[2]}" for e in events]


def before_capture(events: Sequence[tuple[Any, ...]]) -> list[str]:
    names = timeline(events)
    return names[: names.index("capture_begin")]


# ------------------------------------------------------------ every millisecond named


def test_a_lazy_capture_puts_every_millisecond_in_a_named_phase_or_other() -> None:
    r, step, _ = runner()
    first_call(r, step)
    t = time.perf_counter()
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    wall = (time.perf_counter() - t) * 1e3
    p = r.stats().size(4).phases_ms
    assert set(NAMED) <= set(p), sorted(set(NAMED) - set(p))
    named = sum(v for k, v in p.items() if k not in ("total", "other"))
    assert p["other"] >= -0.01  # the named phases never overlap
    assert named + p["other"] == pytest.approx(p["total"], abs=0.02)  # rounded to a microsecond
    assert p["total"] <= wall


def test_time_no_phase_covers_lands_in_other_and_a_slow_phase_shows_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r, step, _ = runner()
    first_call(r, step)
    real_capturing = r._guard.capturing

    @contextlib.contextmanager
    def slow_exit() -> Iterator[None]:  # between the run's end and the bookkeeping
        with real_capturing():
            yield
        time.sleep(0.03)

    monkeypatch.setattr(r._guard, "capturing", slow_exit)
    real_register = r._full.register

    def slow_register(*args: Any) -> None:
        time.sleep(0.03)
        real_register(*args)

    monkeypatch.setattr(r._full, "register", slow_register)
    r(torch.randn(3, 8))
    p = r.stats().size(4).phases_ms
    assert p["other"] >= 30 and p["register"] >= 30, p
    assert p["other"] < p["total"] and p["register"] < p["total"]


def test_a_lazy_capture_reports_its_warmups_and_the_up_front_run_its_phases() -> None:
    r, step, _ = runner()
    first_call(r, step)
    r(torch.randn(3, 8))
    row = r.stats().size(4)
    assert (row.warmups, row.prewarmed, row.warmup_calls) == (0, True, 1)
    assert r.stats().to_dict()["sizes"][2]["phases_ms"]["warmup"] == 0.0
    # With two warmup iterations, the first call stands for the first only.
    r, step, _ = runner(options=gg.CaptureOptions(warmup_iters=2))
    first_call(r, step)
    r(torch.randn(3, 8))
    row = r.stats().size(4)
    assert (row.warmups, row.prewarmed) == (1, True) and row.phases_ms["warmup"] > 0
    up = gg.GraphRunner(
        Step(), (torch.zeros(2, 8),), sizes=SIZES, progress=False, state=[],
        backend=gg.RecordingBackend(),
    )  # fmt: skip
    report = up.capture()
    assert {"snapshot", "lifecycle", "warmup", "capture", "register", "report"} <= set(
        report.phases
    )
    # Up front, the layout probe's forwards at the two largest sizes were their warmups.
    probed = set(sorted(SIZES)[-2:])
    assert [(s.warmups, s.prewarmed) for s in report.sizes] == [
        (0, True) if s.size in probed else (1, False) for s in report.sizes
    ]
    assert report.phases["warmup"] > 0
    # The run's phases never overlap either. The ladder's bookkeeping runs after the
    # lifecycle returned, outside total_s: a collection the re-enabled collector makes
    # there (milliseconds in a worker that ran the HF tests) failed the sum before.
    inside = sum(s for name, s in report.phases.items() if name != "bookkeeping")
    assert inside <= report.total_s + 1e-3


# ------------------------------------------------------------------ the collector


def test_the_collector_is_paused_for_the_whole_lazy_capture_and_restored() -> None:
    r, step, _ = runner()
    seen: dict[str, bool] = {}
    predict, settle = r.door.ledger.predict, r._store.record_run

    def watched_predict(size: int) -> tuple[int, int]:
        seen["budget"] = gc.isenabled()
        return predict(size)

    def watched_settle(*args: Any, **kwargs: Any) -> None:
        seen["bookkeeping"] = gc.isenabled()
        settle(*args, **kwargs)

    r.door.ledger.predict = watched_predict  # type: ignore[method-assign]
    r._store.record_run = watched_settle  # type: ignore[method-assign]
    collected: list[int] = []
    inside = [False]
    lazy = r._lazy
    assert lazy is not None
    real_capture = lazy._capture

    def marked(size: int) -> bool:  # the lazy capture from its budget check to its settle
        inside[0] = True
        try:
            return real_capture(size)
        finally:
            inside[0] = False

    lazy._capture = marked  # type: ignore[method-assign]

    def during(stage: str, info: dict[str, Any]) -> None:
        if stage == "start" and inside[0]:
            collected.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(during)
    gc.set_threshold(1, 1, 1)  # any allocation would collect, were the collector on
    first_call(r, step)
    try:
        assert gc.isenabled()
        r(torch.randn(3, 8))
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(during)
        gc.set_threshold(*threshold)
    assert seen == {"budget": False, "bookkeeping": False}
    assert step.gc_enabled == [False, True]  # the capture; the replay after it
    assert collected == []
    assert r.captured_sizes == (4,)


def test_the_collector_is_restored_on_every_exit_of_a_lazy_capture() -> None:
    # A failed capture (an Exception in it): eager result, collector back on.
    r, step, be = runner()
    step.fail_at = 4
    first_call(r, step)
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert gc.isenabled() and r.stats().size(4).status == "failed"
    # An interrupt propagates, collector back on.
    r, step, be = runner()
    real = be.capture

    def interrupted(body: Any, **kw: Any) -> Any:
        if kw.get("label") == 4:
            raise KeyboardInterrupt
        return real(body, **kw)

    be.capture = interrupted  # type: ignore[method-assign]
    first_call(r, step)
    with pytest.raises(KeyboardInterrupt):
        r(torch.randn(3, 8))
    assert gc.isenabled()
    # Refused over budget before anything ran.
    big = gg.RecordingBackend(graph_bytes=lambda label: (int(label) << 20, 1 << 20))
    r, step, _ = runner(backend=big, budget=3 << 20)
    first_call(r, step, 8)
    r(torch.randn(8, 8))  # the first graph: taken, then over the budget, dropped
    first_call(r, step)
    r(torch.randn(3, 8))  # predicted over: refused
    assert gc.isenabled() and r.stats().size(4).status == "over budget"
    # A collector the caller disabled stays disabled.
    r, step, _ = runner()
    gc.disable()
    try:
        first_call(r, step)
        r(torch.randn(3, 8))
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert r.captured_sizes == (4,)


# ------------------------------------------------------------ a shape the stage warmed


def test_a_warmed_shape_is_captured_without_another_eager_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r, step, _ = runner(warm=True)
    real = streams.assert_streams_idle
    monkeypatch.setattr(
        streams,
        "assert_streams_idle",
        lambda where: (step.events.append(("streams_idle", where)), real(where))[1],
    )
    before = int(step.calls)
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    # sync (earlier steps' work) -> snapshot's sync -> the synchronize that stands for the
    # warmup's -> streams idle -> capture; no eager forward before it.
    assert timeline(step.events) == [
        "synchronize",
        "synchronize",
        "synchronize",
        "streams_idle",
        "capture_begin",
        "forward:capture:4",
        "capture_end",
        "replay",
        "forward:serving:4",
    ]
    assert int(step.calls) == before + 1  # state restored: only the replay counted
    row = r.stats().size(4)
    assert (row.warmups, row.prewarmed) == (0, True)
    assert row.phases_ms["warmup"] == 0.0 and "sync_before_capture" in row.phases_ms
    assert "first warmup before its capture" in str(r.stats())
    # Every size met later: captured the same way, every result equal to eager.
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 17, (1,), generator=g))
        x = torch.randn(n, 8, generator=g)
        torch.testing.assert_close(r(x), x @ step.w + 1)
    assert r.captured_sizes == tuple(SIZES)
    assert all(s.prewarmed and s.warmups == 0 for s in r.stats().sizes)
    assert not [e for e in step.events if e[:2] == ("forward", "warmup")]


def test_a_shape_not_warmed_gets_its_first_warmup_from_its_first_call() -> None:
    r, step, _ = runner(warm=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert timeline(step.events) == ["forward:warmup:4", "synchronize"]  # no capture
    del step.events[:]
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert before_capture(step.events).count("forward:warmup:4") == 0
    assert (r.stats().size(4).warmups, r.stats().size(4).prewarmed) == (0, True)


@pytest.mark.parametrize(
    ("iters", "warm", "eager"), [(3, True, 2), (3, False, 2), (0, True, 0), (0, False, 0)]
)
def test_an_earlier_forward_stands_for_the_first_warmup_iteration_only(
    iters: int, warm: bool, eager: int
) -> None:
    """The stage's (``warm_shapes``) or the first call's; with ``warmup_iters=0`` there is
    no warmup to stand for, and a size's first call captures it."""
    r, step, _ = runner(warm=warm, options=gg.CaptureOptions(warmup_iters=iters))
    if iters and not warm:
        first_call(r, step)
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    seen = before_capture(step.events)
    assert seen.count("forward:warmup:4") == eager, seen
    row = r.stats().size(4)
    assert row.warmups == eager and row.prewarmed == (iters > 0)
    if iters == 0:  # nothing skipped: no synchronize stands in for one
        assert "sync_before_capture" not in row.phases_ms


def test_a_step_without_declared_state_keeps_its_watched_warmup() -> None:
    """The first warmup is where undeclared writes are seen (the canary's verdict waits
    for it): with no ``state=`` it runs even at a warmed shape."""
    r, step, _ = runner(warm=True, state=None)
    x = torch.randn(3, 8)
    r(x)
    assert before_capture(step.events).count("forward:warmup:4") == 1
    assert not r.stats().size(4).prewarmed


def test_the_stage_warms_again_after_a_recapture() -> None:
    r, step, _ = runner(warm=True)
    r(torch.randn(3, 8))
    r.recapture(reason="test: a new stage")
    del step.events[:]
    r(torch.randn(3, 8))
    assert "forward:warmup:4" not in before_capture(step.events)
    assert r.stats().size(4).prewarmed


def _mix_runner(
    ns: str, **kw: Any
) -> tuple[gg.PiecewiseRunner, Callable[[torch.Tensor], torch.Tensor], Any]:
    """A PiecewiseRunner (RecordingBackend, ``state=[]``, sizes 2, 4, 8) over ``x + 1``,
    the custom split op ``<ns>::mix`` (doubles), ``- 1``; the callable, and the op's
    library (keep it alive while the runner is used)."""
    torch._dynamo.reset()
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    lib.impl("mix", lambda x: x * 2, "CPU")
    lib.impl("mix", lambda x: torch.empty_like(x), "Meta")
    op = getattr(torch.ops, ns).mix

    def fn(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(x + 1) - 1
        return out

    runner = gg.PiecewiseRunner(
        fn, (torch.zeros(2, 4),), split_ops=[f"{ns}::mix"], sizes=[2, 4, 8],
        backend=gg.RecordingBackend(), progress=False, state=[], **kw,
    )  # fmt: skip
    return runner, fn, lib


def test_piecewise_and_graphed_causal_lm_capture_warmed_shapes_without_a_warmup() -> None:
    pw, fn, _lib = _mix_runner("gglazycost", lazy=gg.Lazy(warm_shapes=True))
    pw.capture()
    for n in (3, 1, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(pw(x), fn(x))
    assert all(s.prewarmed and s.warmups == 0 for s in pw.stats().sizes)
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama")
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=40, backend=gg.RecordingBackend(), progress=False,
        lazy=gg.Lazy(warm_shapes=True),
    )  # fmt: skip
    g.capture()
    for batch in (3, 1):
        ids, mask = F.prompts(batch, seed=batch)
        want = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
            cache_implementation="static",
        )  # fmt: skip
        assert torch.equal(g.generate(ids, mask, max_new_tokens=5), want)
    rows = [s for s in g.stats().sizes if s.status == "captured"]
    assert rows and all(s.prewarmed and s.warmups == 0 for s in rows)


class _RecordsOnly(gg.RecordingBackend):
    """Says what the CUDA backend says: a capture records the body's kernels, runs none."""

    capture_runs_body = False


@pytest.mark.parametrize(
    ("backend", "warm", "iters", "snapshots"),
    [
        (_RecordsOnly, True, 1, 0),  # the stage's forward was the one warmup: nothing eager
        (_RecordsOnly, True, 2, 1),  # one warmup left runs eagerly
        (_RecordsOnly, False, 1, 0),  # the first call's forward was the one warmup
        (_RecordsOnly, False, 2, 1),
        (gg.RecordingBackend, True, 1, 1),  # the emulated capture runs the body
    ],
)
def test_a_lazy_capture_that_runs_nothing_eagerly_skips_the_state_snapshot(
    monkeypatch: pytest.MonkeyPatch, backend: type, warm: bool, iters: int, snapshots: int
) -> None:
    """No warmup and a capture that only records: the declared state cannot change, so
    neither its snapshot, the synchronize after it, nor its restore is paid."""
    r, step, _ = runner(warm=warm, backend=backend(), options=gg.CaptureOptions(warmup_iters=iters))
    if not warm:
        first_call(r, step)
    taken: list[int] = []
    real = gg.StateSet.snapshot
    monkeypatch.setattr(gg.StateSet, "snapshot", lambda self: taken.append(1) or real(self))
    restored: list[int] = []
    real_restore = gg.StateSet.restore
    monkeypatch.setattr(
        gg.StateSet, "restore", lambda self, snap: restored.append(1) or real_restore(self, snap)
    )
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert (len(taken), len(restored)) == (snapshots, snapshots)
    assert r.stats().size(4).prewarmed
    syncs = before_capture(step.events).count("synchronize")
    # the lazy capture's own, the snapshot's, one per warmup, or one in place of the last
    left = iters - 1
    assert syncs == 1 + snapshots + left + (1 if left == 0 else 0)


def test_piecewise_and_graphed_causal_lm_count_the_probes_forwards_as_first_warmups() -> None:
    """Up front, as for GraphRunner: the layout probe's forward at each of the two largest
    sizes is that size's first warmup (both with ``state=`` declared, as these declare)."""
    pw, fn, _lib = _mix_runner("gglazyprobe")
    report = pw.capture()
    assert [(s.size, s.prewarmed, s.warmups) for s in report.sizes] == [
        (8, True, 0),
        (4, True, 0),
        (2, False, 1),
    ]
    x = torch.randn(3, 4)
    torch.testing.assert_close(pw(x), fn(x))
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama")
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=40, backend=gg.RecordingBackend(), progress=False
    )
    report = g.capture()
    assert [(s.size, s.prewarmed) for s in report.sizes] == [(4, True), (2, True), (1, False)]
    ids, mask = F.prompts(3, seed=3)
    want = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=5, cache_implementation="static"
    )
    assert torch.equal(g.generate(ids, mask, max_new_tokens=5), want)
