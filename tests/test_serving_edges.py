"""Serving edges (issue 38): the serving surface on every wrapper, serving-time calls from
other threads whatever their grad or inference mode, updates that every call sees whole,
and the state left as found after a recapture, on the CPU emulation."""

from __future__ import annotations

import threading

import pytest
import torch

import graphguard as gg
from graphguard.errors import GraphGuardError
from graphguard.integrations.transformers import GraphedCausalLM
from tests import hf_families as F

CACHE = 40


class Affine(torch.nn.Module):
    """``x @ w + b``, with a hook between reading ``w`` and ``b`` (a test pauses there)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.randn(4))
        self.between = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        self.between()
        return y + self.b


def runner(model: torch.nn.Module, **kw) -> gg.GraphRunner:
    kw.setdefault("sizes", [1, 2, 4])
    return gg.GraphRunner(
        model, (torch.zeros(1, 4),), backend=gg.RecordingBackend(), progress=False, state=[], **kw
    )


# ------------------------------------------------------------------ the wrappers' surface


def test_graphed_causal_lm_has_the_runners_serving_surface() -> None:
    g = GraphedCausalLM(
        F.model("llama"), max_batch=2, max_cache_len=16, backend=gg.RecordingBackend(),
        progress=False, provenance=True,
    )  # fmt: skip
    g.capture()
    audit = g.audit()
    assert audit.enabled and {x.kind for gp in audit.graphs for x in gp.reads} >= {"parameter"}
    assert any("embed_tokens" in x.name for gp in audit.graphs for x in gp.reads)
    assert g.canary_stats() == {} and g.check_weights().ok
    report = g.recapture(reason="nothing moved", only_moved=True)
    assert report.captured == [] and g.captured_sizes == (1, 2)


@pytest.mark.compile
def test_the_dispatcher_has_the_runners_serving_surface_by_kind() -> None:
    from tests.test_user_modes import _build

    d = _build(provenance=True)
    d.capture()
    audits = d.audit()
    assert set(audits) == {"full", "piecewise"} and all(a.enabled for a in audits.values())
    assert d.canary_stats() == {"full": {}, "piecewise": {}}
    assert all(v.ok for v in d.verify().values())
    again = d.recapture(reason="config changed")
    assert set(again) == {"full", "piecewise"} and d.full is not None
    assert d.full.captured_sizes == tuple(d.plan.full_sizes)


# ------------------------------------------------------------------ other threads


def test_verify_from_a_thread_outside_the_captures_inference_mode_works() -> None:
    """Grad and inference mode are per thread: a monitor thread's verify runs its eager
    side under the mode the graphs were captured in, not its own."""
    m = Affine()
    r = runner(m)
    with torch.inference_mode():
        r.capture()
        r(torch.randn(3, 4))
    results: list[object] = []
    t = threading.Thread(target=lambda: results.append(r.verify()))
    t.start()
    t.join(30)
    assert len(results) == 1 and results[0].ok  # type: ignore[attr-defined]
    assert r.verify().ok  # the serving thread outside inference mode too


def test_verify_from_another_thread_during_a_lazy_capture_is_refused_as_a_second_caller() -> None:
    m = Affine()
    r = runner(m, lazy=True)
    r.capture()
    caught: list[BaseException] = []

    def monitor() -> None:
        try:
            r.verify()
        except GraphGuardError as exc:
            caught.append(exc)

    def inside() -> None:  # during the warmup of the lazy capture of size 4
        if gg.phase.in_graph_preparation() and not caught:
            t = threading.Thread(target=monitor, name="monitor")
            t.start()
            t.join(10)

    m.between = inside
    r(torch.randn(3, 4))
    assert len(caught) == 1 and "'monitor'" in str(caught[0]) and "serves one" in str(caught[0])


def test_an_update_from_another_thread_waits_for_a_lazy_call_through_its_replay() -> None:
    """The call that captures a new size replays at once: the guard is held from the
    capture through the replay, so an update from another thread lands before the call or
    after it, never between (the call sees the old weights whole). The size's first call
    runs eagerly as its warmup (docs/lazy.md); the second is the one that captures."""
    m = Affine()
    r = runner(m, lazy=True)
    r.capture()
    x = torch.randn(3, 4)
    r(x)  # the size's first call: its warmup, eager
    assert 4 not in r.captured_sizes
    old_w, old_b = m.w.detach().clone(), m.b.detach().clone()
    new = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    started = threading.Event()
    done: list[str] = []

    def trainer() -> None:
        started.wait(10)
        r.update_weights(new)
        done.append("update")

    t = threading.Thread(target=trainer)
    t.start()

    def between() -> None:
        if not gg.phase.in_graph_preparation() and not started.is_set():
            started.set()  # the replay after the capture: the trainer tries now
            t.join(0.3)  # it must wait for this call

    m.between = between
    out = r(x).clone()
    assert started.is_set(), "the second call did not capture and replay size 4"
    t.join(10)
    m.between = lambda: None
    assert done == ["update"]
    torch.testing.assert_close(out, x @ old_w + old_b)
    torch.testing.assert_close(r(x), x @ new["w"] + new["b"])


def test_a_step_under_the_doors_guard_sees_an_update_whole() -> None:
    """A plain replay takes no lock (the hot path); an engine that pushes weights from
    another thread serializes its steps with the update through ``runner.door.exclusive``
    (docs/serving.md): the update waits for the step in flight, every step sees all old
    or all new weights."""
    m = Affine()
    r = runner(m)
    r.capture()
    x = torch.randn(2, 4)
    r(x)
    old_w, old_b = m.w.detach().clone(), m.b.detach().clone()
    new = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    started = threading.Event()

    def trainer() -> None:
        started.wait(10)
        r.update_weights(new)

    t = threading.Thread(target=trainer)
    t.start()

    def between() -> None:  # the emulated replay, between reading w and b
        if not started.is_set():
            started.set()
            t.join(0.3)  # the trainer is waiting for the step's guard

    m.between = between
    with r.door.exclusive("step"):
        out = r(x).clone()
    t.join(10)
    m.between = lambda: None
    torch.testing.assert_close(out, x @ old_w + old_b)
    torch.testing.assert_close(r(x), x @ new["w"] + new["b"])


# ------------------------------------------------------------------ state as found


def test_a_recapture_leaves_the_cache_as_it_found_it_on_the_cpu_too() -> None:
    model = F.model("llama", seed=4)
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=CACHE, backend=gg.RecordingBackend(), progress=False
    )
    g.capture()
    ids, mask = F.prompts(2, seed=1)
    g.generate(ids, mask, max_new_tokens=3)
    before = [
        t.clone()
        for layer in g.cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    ]
    g.recapture(reason="weights reloaded")
    after = [
        t
        for layer in g.cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    ]
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
