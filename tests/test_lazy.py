"""Lazy capture on the CPU (RecordingBackend): the stage, a size's first call (its warmup)
and the lifecycle order of the capture at its next call for each runner kind, failure that
stays local, the graph-memory budget, the serving stats, threads, and the options' errors.
The first call and eviction in depth: ``tests/test_lazy_first_call.py`` and
``tests/test_lazy_evict.py``. The GPU half (the AuxStream hazard, the soak, the ledger
against the device) is ``tests/gpu/test_lazy_gpu.py``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase, streams
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError
from graphguard.phase import Phase

MIB = 1 << 20
SIZES = [1, 2, 4, 8, 16]


class Step(torch.nn.Module):
    """``x @ w + 1`` that records, per forward, the phase and the batch it ran at, and can
    fail (``fail_at``: forwards at that batch in phase ``fail_in`` raise) or write a
    counter (declared state)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.seen: list[tuple[str, int]] = []
        self.fail_at: int | None = None
        self.fail_in = Phase.CAPTURE  # the phase fail_at fails in
        self.events: list[tuple[Any, ...]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        p = phase.current_phase().value
        self.seen.append((p, n))
        if self.events is not None:
            self.events.append(("forward", p, n))
        if self.fail_at == n and phase.current_phase() is self.fail_in:
            raise torch.OutOfMemoryError(f"emulated OOM in {self.fail_in.value} at batch {n}")
        self.calls.add_(1)
        return x @ self.w + 1


def lazy_runner(
    step: Step | None = None,
    *,
    capture_now: Sequence[int] = (),
    budget: int | None = None,
    **kw: Any,
) -> tuple[gg.GraphRunner, Step, Any]:
    step = step or Step()
    be = kw.pop("backend", None) or gg.RecordingBackend()
    kw.setdefault("sizes", SIZES)
    kw.setdefault("progress", False)
    kw.setdefault("state", [step.calls])
    lazy = gg.Lazy(capture_now=capture_now, budget=budget)
    r = gg.GraphRunner(step, (torch.zeros(2, 8),), lazy=lazy, backend=be, **kw)
    return r, step, be


def captures(be: Any) -> list[Any]:
    return [e[1] for e in be.events if e[0] == "capture_begin"]


def twice(r: Any, x: torch.Tensor) -> torch.Tensor:
    """Call ``r`` on ``x`` twice: a new size's first call (its warmup), then its capture."""
    r(x)
    return r(x)  # type: ignore[no-any-return]


@pytest.fixture
def idle_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record every streams-idle check into a list the test shares with the backend."""
    events: list[tuple[Any, ...]] = []
    real = streams.assert_streams_idle

    def checked(where: str) -> None:
        events.append(("streams_idle", where))
        real(where)

    monkeypatch.setattr(streams, "assert_streams_idle", checked)
    return events


# ------------------------------------------------------------------------- the stage


def test_capture_runs_the_stage_only_hooks_see_the_whole_ladder() -> None:
    ws = gg.Workspace("scratch")
    seen: list[tuple[int, ...]] = []
    r, step, be = lazy_runner(
        before_capture=[lambda sizes: (seen.append(tuple(sizes)), ws.reserve(64))],
        workspaces=[ws],
    )
    report = r.capture()
    assert captures(be) == [] and r.captured_sizes == () and report.captured == []
    assert seen == [tuple(sorted(SIZES, reverse=True))]
    # The layout probe ran the two largest sizes uncaptured, so arenas reached their size.
    assert [n for p, n in step.seen] == [16, 8]
    assert ws.locked and phase.current_phase() is Phase.SERVING
    assert r.serving and r.lazy and r.options.capture_error_mode == "thread_local"
    assert int(step.calls) == 0  # the declared state was restored


def test_capture_now_captures_those_sizes_up_front() -> None:
    r, _, be = lazy_runner(capture_now=[16, 2])
    r.capture()
    assert captures(be) == [16, 2] and r.captured_sizes == (2, 16)


# ------------------------------------------------------- a capture on first use, in order


def test_the_first_call_warms_its_padded_size_and_the_next_captures_it_in_order(
    idle_events: list[tuple[Any, ...]],
) -> None:
    step = Step()
    be = gg.RecordingBackend()
    be.events = idle_events  # one timeline: backend events, idle checks, forwards
    step.events = idle_events
    r, _, _ = lazy_runner(step, backend=be)
    r.capture()
    del idle_events[:]
    calls_before = int(step.calls)
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)

    def names() -> list[str]:
        return [e[0] if e[0] != "forward" else f"forward:{e[1]}:{e[2]}" for e in idle_events]

    # The first call: the warmup at the padded size on the caller's rows, a synchronize.
    assert names() == ["forward:warmup:4", "synchronize"], names()
    assert r.captured_sizes == () and int(step.calls) == calls_before + 1
    del idle_events[:]
    torch.testing.assert_close(r(x), x @ step.w + 1)
    # sync (earlier steps' work) -> (the emulation's state snapshot) -> the synchronize
    # that stands for the warmup's -> streams idle -> capture -> replay.
    assert names() == [
        "synchronize",
        "synchronize",  # the state snapshot: the emulated capture runs the body
        "synchronize",
        "streams_idle",
        "capture_begin",
        "forward:capture:4",
        "capture_end",
        "replay",
        "forward:serving:4",  # RecordingBackend's replay re-runs the body
    ], names()
    assert r.captured_sizes == (4,)
    # State restored after capture: each call advanced the counter once.
    assert int(step.calls) == calls_before + 2
    # A later call at 3 or 4 replays; nothing is captured again.
    del idle_events[:]
    r(torch.randn(4, 8))
    assert [e[0] for e in idle_events if e[0] != "forward"] == ["replay"]


def test_every_result_equals_eager_on_random_sizes() -> None:
    r, step, be = lazy_runner()
    r.capture()
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 21, (1,), generator=g))
        x = torch.randn(n, 8, generator=g)
        torch.testing.assert_close(r(x), x @ step.w + 1)
    assert sorted(captures(be)) == SIZES  # each once
    st = r.stats()
    assert st.calls == 60 and st.replays + st.eager_calls == 60
    first = "first call: the size's warmup"
    assert st.eager_reasons == {"above the ladder": st.eager_calls - 5, first: 5}
    assert all(s.how == "lazily" and s.warmup_calls == 1 for s in st.sizes)
    assert sum(s.replays for s in st.sizes) == st.replays


def test_zero_copy_path_first_call_then_capture_keeping_the_written_rows() -> None:
    r, step, be = lazy_runner()
    r.capture()
    # Its first call: static_inputs captures nothing, replay runs the warmup on the rows.
    (buf,) = r.static_inputs(3)
    assert captures(be) == [] and buf.shape == (3, 8)
    x = torch.randn(3, 8)
    buf.copy_(x)
    torch.testing.assert_close(r.replay(3), x @ step.w + 1)
    assert captures(be) == [] and r.stats().size(4).status == "warmed"
    # The next static_inputs captures it, before the batch is written.
    (buf,) = r.static_inputs(3)
    assert captures(be) == [4]
    x = torch.randn(3, 8)
    buf.copy_(x)
    torch.testing.assert_close(r.replay(3), x @ step.w + 1)
    # capture_for names the size; replay alone warms, then captures keeping the rows
    # the caller wrote (a capture resets the buffers).
    assert r.capture_for(7) == 8 and captures(be) == [4]
    (buf,) = r.static_inputs(7)
    for _ in range(3):
        x = torch.randn(7, 8)
        buf.copy_(x)
        torch.testing.assert_close(r.replay(7), x @ step.w + 1)
    assert captures(be) == [4, 8] and r.stats().size(8).replays == 2
    assert r.capture_for(30) is None
    with pytest.raises(GraphGuardError, match=r"no graph for a batch of 30"):
        r.replay(30)


def test_piecewise_runner_captures_lazily_from_one_compile() -> None:
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    lib = torch.library.Library("gglazy", "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    lib.impl("mix", lambda x: x * 2, "CPU")
    lib.impl("mix", lambda x: torch.empty_like(x), "Meta")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gglazy.mix(x + 1) - 1

    be = gg.RecordingBackend()
    r = gg.PiecewiseRunner(
        fn,
        (torch.zeros(2, 4),),
        split_ops=["gglazy::mix"],
        sizes=[2, 4, 8],
        lazy=True,
        backend=be,
        progress=False,
    )
    r.capture()
    assert r.captured_sizes == ()
    for n in (3, 1, 8, 3, 1, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(r(x), fn(x))
    assert r.captured_sizes == (2, 4, 8) and r.compile_count == 1
    assert sorted({c[0] for c in captures(be)}) == [2, 4, 8]


def test_dispatcher_keeps_its_plan_and_each_runner_captures_on_first_use() -> None:
    step = Step()
    d = gg.build_dispatcher(
        step,
        (torch.zeros(2, 8),),
        mode="full",
        max_tokens=16,
        lazy=True,
        state=[step.calls],
        progress=False,
        backend_factory=gg.RecordingBackend,
    )
    d.capture()
    plan = d.plan
    x = torch.randn(5, 8)
    for _ in range(2):  # its first call, then its capture
        torch.testing.assert_close(d(gg.BatchKey.decode(5), x), x @ step.w + 1)
    assert d.plan is plan  # not narrowed to the sizes captured so far
    assert d.stats()["full"].replays == 1


def test_graphed_causal_lm_lazy_generates_like_hf_and_captures_what_it_reaches() -> None:
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama")
    be = gg.RecordingBackend()
    g = GraphedCausalLM(model, max_batch=4, max_cache_len=40, backend=be, progress=False, lazy=True)
    g.capture()
    assert g.captured_sizes == ()
    ids, mask = F.prompts(3, seed=3)
    g.generate(ids, mask, max_new_tokens=1)  # the prefill's token: no decode graph needed
    assert g.captured_sizes == ()
    want = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=6, cache_implementation="static"
    )
    assert torch.equal(g.generate(ids, mask, max_new_tokens=6), want)
    # Its first decode step was the size's warmup; the next captured it.
    assert g.captured_sizes == (4,)
    assert g.stats().size(4).replays == 4 and g.stats().size(4).warmup_calls == 1
    # capture_now and the budget mean what they mean on every runner kind.
    up = GraphedCausalLM(
        model, max_batch=4, max_cache_len=40, backend=gg.RecordingBackend(), progress=False,
        lazy=gg.Lazy(capture_now=[2]),
    )  # fmt: skip
    up.capture()
    assert up.captured_sizes == (2,) and up.runner.options.lazy == gg.Lazy(capture_now=(2,))
    with pytest.raises(ConfigError, match=r"graph_memory_budget moved into lazy=graphguard\.Lazy"):
        GraphedCausalLM(model, max_batch=4, max_cache_len=40, graph_memory_budget=1 << 30)


# ------------------------------------------------------------------ failure stays local


def test_a_failed_lazy_capture_returns_eager_marks_the_size_once_and_pads_past_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, step, be = lazy_runner()
    r.capture()
    step.fail_at = 4
    with caplog.at_level(logging.ERROR, logger="graphguard"):
        x = torch.randn(3, 8)
        for _ in range(2):  # its first call, then its capture fails: eager result, no error
            torch.testing.assert_close(r(x), x @ step.w + 1)
        for _ in range(2):  # 8's first call, then its capture
            torch.testing.assert_close(r(torch.randn(4, 8)).shape, torch.Size([4, 8]))
    errors = [rec for rec in caplog.records if "size 4" in rec.getMessage()]
    assert len(errors) == 1, [rec.getMessage() for rec in caplog.records]
    # Batches of 3 and 4 now pad to 8, captured lazily; 4 is never tried again.
    assert captures(be) == [4, 8] and r.captured_sizes == (8,)
    row = r.stats().size(4)
    assert row.status == "failed" and "OutOfMemoryError" in (row.note or "")
    assert r.padded_size(3) == 8
    # capture() gives refused sizes a new chance.
    step.fail_at = None
    r.release()
    r.capture()
    twice(r, torch.randn(3, 8))
    assert r.captured_sizes == (4,)


def test_a_lazy_stage_whose_forward_raises_fails_capture_and_capture_may_run_again() -> None:
    """The stage's layout-probe forward is the only forward a lazy ``capture()`` runs: one
    that raises (a transient error) fails ``capture()`` with ``GraphCaptureError``, as a
    size's forward does up front. Swallowed, it left the layout unknown and every padded
    batch eager for ever ("no size captured"), with no error and no warning."""
    r, step, be = lazy_runner()
    step.fail_at, step.fail_in = 16, Phase.WARMUP  # the probe's first forward
    with pytest.raises(GraphCaptureError, match=r"lazy stage's forward at size 16 failed") as e:
        r.capture()
    assert e.value.size == 16 and isinstance(e.value.cause, torch.OutOfMemoryError)
    assert "call capture() again" in str(e.value)
    assert not r.serving and r.captured_sizes == ()  # nothing kept: calls are refused
    with pytest.raises(GraphGuardError, match=r"capture\(\)"):
        r(torch.randn(3, 8))
    step.fail_at = None  # the transient error passed: capture() again serves lazily
    r.capture()
    x = torch.randn(3, 8)
    torch.testing.assert_close(twice(r, x), x @ step.w + 1)
    assert r.captured_sizes == (4,) and captures(be) == [4]
    assert "no size captured" not in r.stats().eager_reasons


def test_a_lazy_stage_failure_under_skip_is_logged_and_capture_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``on_capture_error="skip"`` (a failed size logged, the others serve): logged as an
    error, never silent."""
    r, step, _ = lazy_runner(options=gg.CaptureOptions(on_capture_error="skip"))
    step.fail_at, step.fail_in = 16, Phase.WARMUP
    with caplog.at_level(logging.ERROR, logger="graphguard"):
        r.capture()
    (line,) = [m for m in caplog.messages if "lazy stage's forward" in m]
    assert "at size 16 failed: OutOfMemoryError" in line and "on_capture_error='skip'" in line
    assert r.serving


def test_a_warm_shapes_stage_failure_fails_capture_too() -> None:
    step = Step()
    step.fail_at, step.fail_in = 2, Phase.WARMUP  # a warm_shapes forward (not the probe's)
    r = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=SIZES, progress=False, state=[step.calls],
        lazy=gg.Lazy(warm_shapes=True), backend=gg.RecordingBackend(),
    )  # fmt: skip
    with pytest.raises(GraphCaptureError, match=r"lazy stage's forward at size 2 failed"):
        r.capture()
    assert not r.serving


def test_a_keyboard_interrupt_in_a_lazy_capture_drops_that_size_only() -> None:
    r, step, be = lazy_runner(capture_now=[16])
    r.capture()

    def interrupt(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    real = be.capture
    be.capture = lambda body, **kw: interrupt() if kw.get("label") == 4 else real(body, **kw)
    r(torch.randn(3, 8))  # its first call captures nothing
    with pytest.raises(KeyboardInterrupt):
        r(torch.randn(3, 8))
    assert r.captured_sizes == (16,)
    x = torch.randn(9, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)


def test_a_sanitizer_finding_in_a_lazy_capture_is_raised() -> None:
    step = Step()

    class Host(Step):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if phase.is_capturing() and x.shape[0] == 4:
                float(x.sum())  # a host read inside the capture
            return super().forward(x)

    step = Host()
    r, _, _ = lazy_runner(step, sanitize=True)
    r.capture()
    r(torch.randn(3, 8))  # its first call: an uncaptured warmup, no finding
    with pytest.raises(gg.errors.SanitizerError):
        r(torch.randn(3, 8))


# --------------------------------------------------------------------------- the budget


def graph_bytes(label: Any) -> tuple[int, int]:
    """Pool: 1 MiB per row of the size; driver: 2 MiB per graph."""
    return int(label) * MIB, 2 * MIB


def test_a_capture_predicted_over_budget_does_not_happen(caplog: pytest.LogCaptureFixture) -> None:
    be = gg.RecordingBackend(graph_bytes=graph_bytes)
    r, step, _ = lazy_runner(backend=be, budget=15 * MIB)
    r.capture()
    twice(r, torch.randn(1, 8))  # 1 MiB pool + 2 MiB driver
    twice(r, torch.randn(8, 8))  # 8 MiB pool + 4 MiB driver = 12 MiB: two pool sizes known
    assert r.door.ledger.used == 12 * MIB
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        for _ in range(4):  # its first call, then 16 predicted: +8 pool +2
            x = torch.randn(12, 8)
            torch.testing.assert_close(r(x), x @ step.w + 1)
    assert captures(be) == [1, 8]
    over = [rec.getMessage() for rec in caplog.records if "over budget" in rec.getMessage()]
    assert len(over) == 1 and "8.0 MiB of pool" in over[0] and "15.0 MiB budget" in over[0]
    assert r.stats().size(16).status == "over budget"
    # Counted under the real reason: 12 pads to 16, which is over budget (not "above").
    first = "first call: the size's warmup"
    assert r.stats().eager_reasons == {first: 3, "size over budget": 3}
    # Smaller sizes reuse the pool: predicted +2 MiB (driver) each, they fit.
    twice(r, torch.randn(3, 8))
    assert r.captured_sizes == (1, 4, 8) and r.door.ledger.used == 14 * MIB
    assert be.free_bytes() == be.device_bytes - r.door.ledger.used


def test_an_over_budget_refusal_states_the_total_the_capture_would_reach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log said "... to pool 8.0 MiB + driver 4.0 MiB = 12.0 MiB of a 15.0 MiB budget":
    the current use as if it were the total, so a refusal read as under budget."""
    be = gg.RecordingBackend(graph_bytes=graph_bytes)
    r, _, _ = lazy_runner(backend=be, budget=15 * MIB)
    r.capture()
    twice(r, torch.randn(1, 8))
    twice(r, torch.randn(8, 8))  # 12 MiB held
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        twice(r, torch.randn(12, 8))  # 16: +8 MiB pool +2 MiB driver predicted
    (line,) = [rec.getMessage() for rec in caplog.records if "over budget" in rec.getMessage()]
    assert "would take the graphs to 22.0 MiB of a 15.0 MiB budget" in line
    assert "8.0 MiB of pool and 2.0 MiB outside the allocator" in line
    assert "= 12.0 MiB held now" in line and "12.0 MiB of a" not in line


def test_a_first_capture_that_turns_out_over_budget_is_dropped_and_gives_memory_back() -> None:
    be = gg.RecordingBackend(graph_bytes=graph_bytes)
    r, step, _ = lazy_runner(backend=be, budget=5 * MIB)
    r.capture()
    x = torch.randn(7, 8)
    torch.testing.assert_close(twice(r, x), x @ step.w + 1)
    assert captures(be) == [8] and r.captured_sizes == ()
    assert r.stats().size(8).status == "over budget"
    # The pool's last graph took the pool with it: everything is back.
    assert r.door.ledger.used == 0 and be.free_bytes() == be.device_bytes

    # With a graph left in the pool, a dropped graph's pool blocks stay (and stay counted).
    def superlinear(label: Any) -> tuple[int, int]:
        return (20 if int(label) == 8 else int(label)) * MIB, 2 * MIB

    be2 = gg.RecordingBackend(graph_bytes=superlinear)
    r2, step2, _ = lazy_runner(backend=be2, budget=14 * MIB, capture_now=[4])
    r2.capture()  # size 4: 4 MiB pool + 2 MiB driver
    x = torch.randn(7, 8)
    torch.testing.assert_close(twice(r2, x), x @ step2.w + 1)  # 8 predicted +0 +2, took +16 +2
    assert captures(be2) == [4, 8] and r2.captured_sizes == (4,)
    assert r2.stats().size(8).status == "over budget"
    assert r2.door.ledger.pool_bytes == 20 * MIB and r2.door.ledger.driver_bytes == 2 * MIB
    assert be2.free_bytes() == be2.device_bytes - r2.door.ledger.used


def test_release_gives_back_what_capture_took_and_clears_the_ledger() -> None:
    be = gg.RecordingBackend(graph_bytes=graph_bytes)
    r, _, _ = lazy_runner(backend=be)
    r.capture()
    for n in (16, 3, 1):
        twice(r, torch.randn(n, 8))
    assert r.door.ledger.used == 16 * MIB + 3 * 2 * MIB
    assert be.device_bytes - be.free_bytes() == r.door.ledger.used
    report_driver = sum(r.door.ledger.driver.values())
    assert report_driver == 6 * MIB
    r.release()
    assert r.door.ledger.used == 0 and be.free_bytes() == be.device_bytes


def test_estimate_graph_memory_includes_the_driver_share() -> None:
    be = gg.RecordingBackend(graph_bytes=graph_bytes)
    step = Step()
    r = gg.GraphRunner(step, (torch.zeros(2, 8),), sizes=SIZES, backend=be, progress=False)
    est = r.estimate_graph_memory()
    # The pool of the ladder is its largest graph's (16 MiB), plus 2 MiB per graph.
    assert est == 16 * MIB + len(SIZES) * 2 * MIB
    assert be.free_bytes() == be.device_bytes  # the throwaway capture gave it all back
    report = r.capture()
    assert report.driver_bytes == len(SIZES) * 2 * MIB
    assert report.pool_bytes + report.driver_bytes == est
    assert "outside the allocator" in report.summary()


# ---------------------------------------------------------------------------- the stats


def test_stats_warn_once_about_eager_traffic_above_the_ladder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, _, _ = lazy_runner(sizes=[1, 2, 4])
    r.capture()
    small, big = torch.randn(2, 8), torch.randn(9, 8)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        for i in range(1400):  # looked at on the 64th, 128th ... eager call
            r(big if i % 10 == 0 else small)
    warned = [rec.getMessage() for rec in caplog.records if "ran eagerly above" in rec.getMessage()]
    assert len(warned) == 1 and "batches up to 9" in warned[0]
    st = r.stats()
    # Batch 2's first call ran eagerly, as size 2's warmup: not above the ladder.
    assert st.eager_batches == {2: 1, 9: 140} and st.size(2).replays == 1259
    assert "ran eagerly above" in st.table() and st.to_dict()["calls"] == 1400


def test_stats_warn_about_a_captured_size_that_is_never_replayed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import graphguard.stats as stats_mod

    monkeypatch.setattr(stats_mod, "UNUSED_AFTER", 50)
    step = Step()
    r = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=[2, 8], backend=gg.RecordingBackend(), progress=False
    )
    r.capture()
    for _ in range(60):
        r(torch.randn(2, 8))
    st = r.stats()
    assert st.size(8).replays == 0 and st.size(2).replays == 60
    assert any("size 8 has not been replayed" in w for w in st.warnings)
    assert st.size(8).how == "up front" and st.size(8).status == "captured"


def test_stats_keep_counting_across_entry_rebuilds_and_with_a_canary() -> None:
    r, _, _ = lazy_runner(canary=gg.Canary(every=3))
    r.capture()
    for _ in range(8):  # size 2's first call, then 7 replays
        r(torch.randn(2, 8))
    twice(r, torch.randn(5, 8))  # a lazy capture rebuilds entries
    for _ in range(2):
        r(torch.randn(2, 8))
    st = r.stats()
    assert st.size(2).replays == 9 and st.size(8).replays == 1
    assert r.canary_stats()[2].checks >= 2


# ---------------------------------------------------------------- threads and options


def test_a_second_thread_calling_while_a_lazy_capture_runs_is_refused() -> None:
    step = Step()
    r, _, _ = lazy_runner(step)
    r.capture()
    caught: list[BaseException] = []

    def other() -> None:
        try:
            r(torch.randn(1, 8))
        except BaseException as exc:
            caught.append(exc)

    class Racing(Step):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if phase.current_phase() is Phase.WARMUP and x.shape[0] == 4 and not caught:
                t = threading.Thread(target=other, name="second")
                t.start()
                t.join()
            return super().forward(x)

    racing = Racing()
    racing.w = step.w
    r, _, _ = lazy_runner(racing)
    r.capture()
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), x @ step.w + 1)
    assert len(caught) == 1 and isinstance(caught[0], GraphGuardError)
    assert "'second'" in str(caught[0]) and "serves one" in str(caught[0])


def test_lazy_options_are_checked() -> None:
    step = Step()
    ex = (torch.zeros(2, 8),)
    be = gg.RecordingBackend()
    # The 0.2 flat keywords say where they moved, from every runner and the options.
    moved = r"graph_memory_budget moved into lazy=graphguard\.Lazy\(budget=.*\) in 0\.3"
    with pytest.raises(ConfigError, match=moved):
        gg.GraphRunner(step, ex, sizes=SIZES, graph_memory_budget=MIB, backend=be)
    now = r"capture_now moved into lazy=graphguard\.Lazy\(capture_now=\[\.\.\.\]\) in 0\.3"
    with pytest.raises(ConfigError, match=now):
        gg.GraphRunner(step, ex, sizes=SIZES, lazy=True, capture_now=[4], backend=be)
    with pytest.raises(ConfigError, match=now):
        gg.CaptureOptions(capture_now=[4])
    with pytest.raises(ConfigError, match=moved):
        gg.PiecewiseRunner(step, ex, split_ops=["x::y"], graph_memory_budget=MIB)
    with pytest.raises(ConfigError, match=r"Lazy\(capture_now=\[3\]\) are not sizes"):
        gg.GraphRunner(step, ex, sizes=SIZES, lazy=gg.Lazy(capture_now=[3]), backend=be)
    with pytest.raises(ConfigError, match=r"Lazy\(budget=\.\.\.\) must be a positive int"):
        gg.Lazy(budget=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"e\.g\. budget=2 << 30"):
        gg.Lazy(budget=0)
    with pytest.raises(ConfigError, match="capture_now"):
        gg.Lazy(capture_now=[0])
    with pytest.raises(ConfigError, match=r"did you mean 'capture_now'"):
        gg.Lazy(capture_nw=[1])  # type: ignore[call-arg]
    # The shorthand: True is Lazy(), False is no lazy capture.
    assert gg.CaptureOptions(lazy=True).lazy == gg.Lazy()  # type: ignore[arg-type]
    assert gg.CaptureOptions(lazy=False).lazy is None  # type: ignore[arg-type]
    assert gg.Lazy(capture_now=[4, 1]).capture_now == (1, 4)
    with pytest.raises(ConfigError, match="lazy"):
        gg.CaptureOptions(lazy="yes")  # type: ignore[arg-type]
    # An explicit capture_error_mode wins over the lazy default.
    r = gg.GraphRunner(
        step,
        ex,
        sizes=SIZES,
        lazy=True,
        backend=be,
        options=gg.CaptureOptions(capture_error_mode="global"),
    )
    assert r.options.capture_error_mode == "global"
    assert gg.GraphRunner(step, ex, sizes=SIZES, backend=be).options.capture_error_mode == "global"


def test_calls_before_capture_and_after_release_say_so() -> None:
    r, _, _ = lazy_runner()
    with pytest.raises(GraphGuardError, match="before capture"):
        r(torch.randn(3, 8))
    r.capture()
    r.release()
    with pytest.raises(GraphGuardError, match="after release"):
        r(torch.randn(3, 8))


# ------------------------------------------ the lifecycle order for every runner kind


def _assert_order(events: list[tuple[Any, ...]]) -> None:
    """A lazy capture's timeline: a synchronize first, then (warmups and their
    synchronizes) the streams-idle check, every capture (one per piece under PIECEWISE)
    after it, and the first replay after the last capture."""
    names = [e[0] for e in events]
    first = {k: names.index(k) for k in ("synchronize", "streams_idle", "capture_begin", "replay")}
    last_end = len(names) - 1 - names[::-1].index("capture_end")
    assert names[0] == "synchronize", names
    assert first["synchronize"] < first["streams_idle"] < first["capture_begin"], names
    assert last_end < first["replay"], names
    assert names.count("streams_idle") >= 1


def test_the_order_holds_for_piecewise_dispatcher_and_graphed_causal_lm(
    idle_events: list[tuple[Any, ...]],
) -> None:
    """At a size's second call: sync -> (warmup, sync) -> streams idle -> capture ->
    replay, and state restored, for each runner kind (GraphRunner's own test above spells
    out every event, the first call's too)."""
    # PiecewiseRunner: one capture per piece at the size, all after the idle check.
    torch._dynamo.reset()
    lib = torch.library.Library("gglazy2", "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    lib.impl("mix", lambda x: x * 2, "CPU")
    lib.impl("mix", lambda x: torch.empty_like(x), "Meta")
    calls = torch.zeros((), dtype=torch.int64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gglazy2.mix(x + 1) - 1

    be = gg.RecordingBackend()
    be.events = idle_events
    pw = gg.PiecewiseRunner(
        fn, (torch.zeros(2, 4),), split_ops=["gglazy2::mix"], sizes=[2, 4], lazy=True,
        backend=be, progress=False, state=[calls],
    )  # fmt: skip
    pw.capture()
    pw(torch.randn(3, 4))  # its first call
    del idle_events[:]
    pw(torch.randn(3, 4))
    _assert_order(idle_events)
    # The dispatcher's FULL runner.
    step = Step()
    d = gg.build_dispatcher(
        step, (torch.zeros(2, 8),), mode="full", max_tokens=8, lazy=True,
        state=[step.calls], progress=False, backend_factory=lambda: be,
    )  # fmt: skip
    d.capture()
    d(gg.BatchKey.decode(3), torch.randn(3, 8))  # its first call
    del idle_events[:]
    before = int(step.calls)
    d(gg.BatchKey.decode(3), torch.randn(3, 8))
    _assert_order(idle_events)
    assert int(step.calls) == before + 1  # the capture's forwards were restored
    # GraphedCausalLM: the cache (its declared state) is as generation left it.
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("gpt2")
    g = GraphedCausalLM(model, max_batch=4, max_cache_len=40, backend=be, progress=False, lazy=True)
    g.capture()
    ids, mask = F.prompts(2, seed=1)
    g.generate(ids, mask, max_new_tokens=2)  # its one decode step: the size's first call
    del idle_events[:]
    g.generate(ids, mask, max_new_tokens=3)
    _assert_order([e for e in idle_events if e[0] != "forward"])


@pytest.mark.compile
def test_compile_true_compiles_once_at_the_stage_and_captures_lazily() -> None:
    w = torch.randn(8, 8)

    def compiled_step(x: torch.Tensor) -> torch.Tensor:  # its own code object: own cache
        return torch.relu(x @ w) + 1

    be = gg.RecordingBackend()
    r = gg.GraphRunner(
        compiled_step, (torch.zeros(2, 8),), compile=True, lazy=True,
        backend=be, progress=False, state=[],
    options=gg.CaptureOptions(max_size=16))  # fmt: skip
    report = r.capture()
    assert r.captured_sizes == () and report.compiles == 1
    for n in (3, 9, 16, 1, 3, 9, 1):  # 9 and 16 pad to 16: its first call, its capture
        x = torch.randn(n, 8)
        torch.testing.assert_close(r(x), compiled_step(x))
    assert r.compiled_step is not None and r.compiled_step.compiles == 1
    assert sorted(captures(be)) == sorted({r.door.pad_table.padded(n) for n in (3, 9, 16, 1)})


def test_a_lazy_canary_judges_undeclared_writes_at_the_first_lazy_capture() -> None:
    """The stage watches no warmup, so the canary's refusal of a step that writes tensors
    it did not declare waits for the first call at a lazy size, the watched warmup (a pure
    step is never refused)."""

    class Pure(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    pure = Pure()
    r = gg.GraphRunner(
        pure, (torch.zeros(2, 8),), sizes=[4, 8], lazy=True, backend=gg.RecordingBackend(),
        progress=False, canary=gg.Canary(every=2),
    )  # fmt: skip
    r.capture()
    for _ in range(5):  # its first call, then the capture and four replays
        x = torch.randn(3, 8)
        torch.testing.assert_close(r(x), x @ pure.w)
    assert r.canary_stats()[4].checks == 2
    step = Step()  # writes its `calls` buffer, undeclared here
    w = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=[4, 8], lazy=True, backend=gg.RecordingBackend(),
        progress=False, canary=gg.Canary(every=2),
    )  # fmt: skip
    w.capture()
    with pytest.raises(ConfigError, match="calls"):
        w(torch.randn(3, 8))


@pytest.mark.compile
def test_graphed_causal_lm_lazy_with_compile_compiles_once_and_captures_on_the_way() -> None:
    """One compile at the stage, then each size the generations reach is captured from it,
    the tokens equal to HF's. Dynamo's caches are process-wide (the compiled code of an HF
    decoder layer is shared by every instance), so they are emptied before and after."""
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    torch._dynamo.reset()
    try:
        model = F.model("llama")
        be = gg.RecordingBackend()
        g = GraphedCausalLM(
            model, max_batch=8, max_cache_len=40, backend=be, progress=False,
            compile=True, lazy=True,
        )  # fmt: skip
        report = g.capture()
        assert g.captured_sizes == () and report.compiles == 1
        for batch in (3, 6, 2):
            ids, mask = F.prompts(batch, seed=batch)
            want = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
                cache_implementation="static",
            )  # fmt: skip
            assert torch.equal(g.generate(ids, mask, max_new_tokens=5), want), batch
        assert g.compiled_step is not None
        assert g.compiled_step.compiles == 1  # the lazy captures reused the stage's compile
        labels = [e[1] for e in be.events if e[0] == "capture_begin"]
        assert g.captured_sizes == (2, 4, 8) and sorted(labels) == [2, 4, 8]
    finally:
        phase.reset()
        torch._dynamo.reset()
