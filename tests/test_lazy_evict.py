"""Graphs that live inside a byte budget by eviction (``Lazy(budget=..., evict="lru")``,
issue 41), on the CPU with RecordingBackend's emulated memory (a pool reserves what its
largest graph needs: 1 MiB per row here; driver: 2 MiB per live graph). With ``evict``
every lazily captured size has a pool of its own, so a graph of size ``s`` holds ``s + 2``
MiB and gives exactly that back when it goes: the least recently replayed graphs go
first, the ledger charges each graph its own pool and driver share and follows free
memory after each eviction; a new size is predicted from its measured neighbours; an
evicted size met again is captured again, warm, on that call; a size that cannot fit even
alone is refused with the reason and evicts nothing; a failed capture stays local;
``stats()`` counts evictions, recaptures and hits per size. Without ``evict`` the graphs
share one pool as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.errors import ConfigError

MIB = 1 << 20
SIZES = [1, 2, 4, 8, 16]


def graph_bytes(label: Any) -> tuple[int, int]:
    return int(label) * MIB, 2 * MIB


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + 1


def make(
    budget: int, evict: str | None = "lru", **kw: Any
) -> tuple[gg.GraphRunner, Step, gg.RecordingBackend]:
    step = Step()
    be = kw.pop("backend", None) or gg.RecordingBackend(graph_bytes=graph_bytes)
    r = gg.GraphRunner(
        step, (torch.zeros(2, 8),), sizes=SIZES, lazy=gg.Lazy(budget=budget, evict=evict, **kw),
        backend=be, progress=False, state=[],
    )  # fmt: skip
    r.capture()
    return r, step, be


def call(r: gg.GraphRunner, step: Step, n: int, times: int = 1) -> None:
    for _ in range(times):
        x = torch.randn(n, 8)
        torch.testing.assert_close(r(x), x @ step.w + 1)


def captures(be: gg.RecordingBackend) -> list[Any]:
    return [e[1] for e in be.events if e[0] == "capture_begin"]


def device_used(be: gg.RecordingBackend) -> int:
    return be.device_bytes - be.free_bytes()


def test_the_least_recently_replayed_graph_goes_first_and_comes_back_warm() -> None:
    # Own pools: a graph of s rows holds s + 2 MiB. 12 MiB: 4 and 1 fit (9), not 2 beside.
    r, step, be = make(12 * MIB)
    call(r, step, 4, 3)  # first call, capture, replay
    call(r, step, 1, 3)
    call(r, step, 3)  # 4 replayed after 1: 1 is now the least recently replayed
    assert r.captured_sizes == (1, 4) and r.door.ledger.used == device_used(be) == 9 * MIB
    call(r, step, 2)  # size 2's first call: eager, nothing captured, nothing evicted
    assert r.stats().evictions == 0 and r.captured_sizes == (1, 4)
    call(r, step, 2)  # its capture: predicted 2 + 2 (between 1 and 4): 13 > 12, 1 goes
    st = r.stats()
    assert r.captured_sizes == (2, 4) and st.size(1).status == "evicted"
    assert (st.size(1).evictions, st.size(4).evictions, st.evictions) == (1, 0, 1)
    # Size 1's own pool and driver share came back: the ledger is the two graphs left.
    ledger = r.door.ledger
    assert ledger.pool == {2: 2 * MIB, 4: 4 * MIB} and ledger.driver_bytes == 4 * MIB
    assert ledger.used == device_used(be) == 10 * MIB and ledger.driver_adjust == 0
    # Met again: captured on that call (its shape ran: no eager first call); 4, replayed
    # before 2 was captured, is the least recent now.
    before = captures(be)
    call(r, step, 1)
    st = r.stats()
    assert captures(be) == [*before, 1] and r.captured_sizes == (1, 2)
    row = st.size(1)
    assert (row.recaptures, row.warmup_calls, row.prewarmed, row.warmups) == (1, 1, True, 0)
    assert st.size(4).status == "evicted" and st.evictions == 2
    assert ledger.used == device_used(be) == 7 * MIB
    assert "2 evictions" in st.table() and "evicted 1x, recaptured 1x" in st.table()


def test_hits_evictions_and_recaptures_are_counted_per_size() -> None:
    r, step, _ = make(8 * MIB)  # one graph of 4 (6 MiB), or 1 and 2 (7 MiB)
    call(r, step, 4, 4)  # first call, then the capture's call and 2 more: 3 replays
    call(r, step, 1, 3)  # 4 goes for 1
    call(r, step, 2, 3)  # fits beside 1
    call(r, step, 4, 2)  # 4 again: 1 and 2 go (predicted 6 beside 7 > 8)
    st = r.stats()
    hits = {s.size: s.replays for s in st.sizes if s.replays}
    assert hits == {4: 5, 1: 2, 2: 2}  # 3, then 2 more after its recapture; 2; 2
    assert {s.size: s.evictions for s in st.sizes if s.evictions} == {4: 1, 1: 1, 2: 1}
    assert {s.size: s.recaptures for s in st.sizes if s.recaptures} == {4: 1}
    assert st.evictions == 3 and r.captured_sizes == (4,)
    assert st.replays == sum(hits.values()) and st.hit_rate == st.replays / st.calls


def test_recency_is_read_from_replay_counts_at_lazy_events_only() -> None:
    """Nothing on the replay path: the order comes from each entry's replay count, looked
    at by lazy captures and first calls; between two looks, the size replayed more is
    the more recent."""
    r, step, _ = make(64 * MIB)
    for n in (1, 2, 4):
        call(r, step, n, 2)
    assert r.door.recency() == [1, 2, 4]  # each replayed once since its capture, in order
    call(r, step, 1, 3)
    call(r, step, 2, 1)
    assert r.door.recency() == [4, 2, 1]  # 4 not replayed since; 1 replayed more than 2
    assert r.door.recency() == [4, 2, 1]  # nothing replayed since: the same order


def test_each_graph_is_charged_its_own_pool_and_eviction_returns_it() -> None:
    r, step, be = make(64 * MIB)
    for n in (8, 1, 2):
        call(r, step, n, 2)
    ledger = r.door.ledger
    assert ledger.pool == {1: MIB, 2: 2 * MIB, 8: 8 * MIB}  # the sum, not the largest
    assert ledger.used == device_used(be) == 17 * MIB
    used = device_used(be)
    r.door.evict(8)
    assert used - device_used(be) == 10 * MIB  # its pool and its driver share, exactly
    assert ledger.used == device_used(be) == 7 * MIB and ledger.pool_bytes == 3 * MIB


def test_a_size_that_cannot_fit_alone_is_refused_with_the_reason_and_evicts_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, step, be = make(12 * MIB)
    call(r, step, 1, 2)
    call(r, step, 4, 2)  # measured: 1 -> 1 MiB, 4 -> 4 MiB of pool, 2 MiB of driver each
    assert r.door.ledger.predict_alone(16) == 18 * MIB  # the line through its neighbours
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        call(r, step, 16, 3)  # first call, then refused on the prediction: eager
    st = r.stats()
    assert st.size(16).status == "over budget" and st.evictions == 0
    assert r.captured_sizes == (1, 4) and 16 not in captures(be)
    note = st.size(16).note or ""
    assert "size 16 alone is predicted to take 18.0 MiB" in note, note
    assert "over the whole 12.0 MiB budget" in note and "at least 18.0 MiB" in note
    assert any("over budget" in m and "size 16 alone" in m for m in caplog.messages)


def test_a_blind_capture_over_the_budget_is_dropped_and_its_pool_returned() -> None:
    """Nothing measured yet: the first size is captured on no prediction and checked
    after; over the whole budget alone, it is dropped and its own pool goes with it."""
    r, step, be = make(12 * MIB)
    call(r, step, 16, 2)  # 16 + 2 = 18 > 12
    st = r.stats()
    assert st.size(16).status == "over budget" and captures(be) == [16]
    assert r.captured_sizes == () and r.door.ledger.used == device_used(be) == 0
    call(r, step, 4, 2)  # one size measured: a guess (16's bytes per row), checked after

    assert r.captured_sizes == (4,) and r.door.ledger.used == device_used(be) == 6 * MIB


def test_a_capture_that_took_more_than_predicted_evicts_others_not_itself() -> None:
    def superlinear(label: Any) -> tuple[int, int]:
        return (14 if int(label) == 4 else int(label)) * MIB, 2 * MIB

    be = gg.RecordingBackend(graph_bytes=superlinear)
    r, step, _ = make(23 * MIB, backend=be)
    call(r, step, 2, 2)  # 2 + 2
    call(r, step, 1, 2)  # 1 + 2: 7
    call(r, step, 8, 2)  # 8 + 2: 17
    call(r, step, 2)
    call(r, step, 1)  # 8 now the least recent
    call(r, step, 3, 2)  # 4 predicted 4 + 2 (between 2 and 8): 23, fits; took 14 + 2: 8 goes
    st = r.stats()
    assert r.captured_sizes == (1, 2, 4) and st.size(8).status == "evicted"
    assert r.door.ledger.used == device_used(be) == 23 * MIB  # took 16, not 6: still fits
    r2, step2, be2 = make(20 * MIB, backend=gg.RecordingBackend(graph_bytes=superlinear))
    call(r2, step2, 2, 2)
    call(r2, step2, 1, 2)  # 7
    call(r2, step2, 3, 2)  # predicted 4 + 2 = 13: fits; took 14 + 2 = 23 > 20: 2 goes
    st = r2.stats()
    assert r2.captured_sizes == (1, 4) and st.size(2).status == "evicted"
    assert r2.door.ledger.used == device_used(be2) == 19 * MIB


def test_a_failed_capture_stays_local_and_evicts_nothing_after_it() -> None:
    r, step, be = make(64 * MIB)
    be.fail_on = {4}
    call(r, step, 1, 2)
    call(r, step, 3, 2)  # first call, then the capture fails: eager, size 4 failed
    st = r.stats()
    assert st.size(4).status == "failed" and r.captured_sizes == (1,)
    assert r.door.ledger.used == device_used(be) == 3 * MIB and st.evictions == 0
    call(r, step, 1, 2)  # size 1 still replays
    assert r.stats().size(1).replays == 3


def test_refusing_keeps_the_shared_pool() -> None:
    """Without ``evict`` nothing changes: the graphs share one pool (its largest graph's
    blocks), no pool of their own."""
    r, step, be = make(64 * MIB, evict=None)
    for n in (8, 1, 2):
        call(r, step, n, 2)
    assert r.door.ledger.pool_bytes == 8 * MIB and r.door.ledger.used == 14 * MIB
    assert device_used(be) == 14 * MIB and not r.door.ledger.own_pools


def test_the_refusal_stays_the_default_and_evict_needs_a_budget() -> None:
    r, step, _ = make(15 * MIB, evict=None)
    call(r, step, 8, 2)
    call(r, step, 1, 2)
    call(r, step, 2, 2)
    call(r, step, 3, 3)  # would exceed: refused, runs eagerly
    st = r.stats()
    assert st.size(4).status == "over budget" and st.evictions == 0
    with pytest.raises(ConfigError, match=r"evict='lru'.*budget is None"):
        gg.Lazy(evict="lru")
    with pytest.raises(ConfigError, match=r"Lazy\(evict=\.\.\.\) must be None .* or 'lru'"):
        gg.Lazy(budget=MIB, evict="fifo")


def test_release_forgets_evictions_and_a_new_stage_warms_again() -> None:
    r, step, _ = make(15 * MIB)
    call(r, step, 8, 2)
    call(r, step, 1, 2)
    call(r, step, 2, 2)
    call(r, step, 3, 2)
    assert r.stats().evictions == 1
    r.release()
    r.capture()
    st = r.stats()
    assert {s.status for s in st.sizes} == {"pending"} and r.door.ledger.used == 0
    call(r, step, 8)
    assert r.stats().size(8).status == "warmed"  # a first call again: a new stage


def test_the_zero_copy_path_captures_an_evicted_size_again() -> None:
    r, step, _ = make(12 * MIB)
    call(r, step, 4, 2)
    call(r, step, 1, 2)
    call(r, step, 2, 2)  # evicts 4
    assert r.stats().size(4).status == "evicted"
    assert r.capture_for(4) == 4 and 4 in r.captured_sizes
    (buf,) = r.static_inputs(4)
    x = torch.randn(4, 8)
    buf.copy_(x)
    torch.testing.assert_close(r.replay(4), x @ step.w + 1)


class KeepsSome(gg.RecordingBackend):
    """A driver that keeps a quarter of each destroyed graph's share (as the H200's kept
    part of a released ladder's): free memory shows only three quarters come back."""

    def _graph_freed(self, graph: Any) -> None:
        super()._graph_freed(graph)
        self._driver += graph.driver // 4


def test_what_the_driver_keeps_of_an_evicted_graph_stays_counted() -> None:
    be = KeepsSome(graph_bytes=graph_bytes)
    r, step, _ = make(12 * MIB, backend=be)
    call(r, step, 4, 2)
    call(r, step, 1, 2)  # 6 + 3 = 9 MiB
    call(r, step, 2, 2)  # 4 predicted: 4 goes, 5.5 MiB of its 6 come back
    ledger = r.door.ledger
    st = r.stats()
    assert st.evictions == 1 and ledger.driver_adjust == MIB // 2
    assert ledger.used == device_used(be) == 7 * MIB + MIB // 2
    assert "+ 0.5 MiB driver after evictions" in st.table() and st.driver_adjust_bytes == MIB // 2


def test_a_new_size_is_predicted_from_its_measured_neighbours() -> None:
    """A pool's fixed part (a workspace, on CUDA in one shared pool instead) plus bytes per
    row: between two measured sizes the line through them, beyond them the line through
    the two nearest, and a size measured before (evicted since) its own numbers."""
    be = gg.RecordingBackend(graph_bytes=lambda label: ((4 + int(label)) * MIB, 2 * MIB))
    r, step, _ = make(64 * MIB, backend=be)
    call(r, step, 1, 2)  # 5 MiB of pool
    call(r, step, 8, 2)  # 12
    ledger = r.door.ledger
    assert ledger.predict(4) == (8 * MIB, 2 * MIB)  # between: 5 + 7 * 3 / 7
    assert ledger.predict(16) == (20 * MIB, 2 * MIB)  # beyond: the same line
    r.door.evict(8)
    assert ledger.predict(8) == (12 * MIB, 2 * MIB)  # evicted: still measured
    call(r, step, 3, 2)
    assert ledger.pool[4] == 8 * MIB  # the prediction was the measure
