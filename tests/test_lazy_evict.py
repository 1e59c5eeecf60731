"""Graphs that live inside a byte budget by eviction (``Lazy(budget=..., evict="lru")``,
issue 41), on the CPU with RecordingBackend's emulated memory (pool: 1 MiB per row of the
largest size captured into it, blocks shared; driver: 2 MiB per live graph): the least
recently replayed graphs go first, their driver share comes back and the ledger says so,
their pool blocks stay until the pool's last graph goes; an evicted size met again is
captured again, warm, on that call; a size that cannot fit even alone is refused and
evicts nothing; ``stats()`` counts evictions, recaptures and hits per size."""

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
    # 8 MiB of pool (size 8 first) + 2 MiB per graph: three graphs fit in 15 MiB, not four.
    r, step, be = make(15 * MIB)
    call(r, step, 8, 3)  # first call, capture, replay
    call(r, step, 1, 3)
    call(r, step, 2, 2)
    assert r.captured_sizes == (1, 2, 8) and r.door.ledger.used == 14 * MIB
    call(r, step, 1, 2)  # 1 replayed since: 8 is the least recently replayed
    call(r, step, 3)  # size 4's first call: nothing captured, nothing evicted
    assert r.stats().evictions == 0
    call(r, step, 3)  # its capture: +2 MiB of driver would make 16: 8 goes
    st = r.stats()
    assert r.captured_sizes == (1, 2, 4) and st.size(8).status == "evicted"
    assert (st.size(8).evictions, st.evictions) == (1, 1)
    # Its driver share came back; its pool blocks stay in the pool (counted as dropped).
    ledger = r.door.ledger
    assert ledger.driver_bytes == 6 * MIB and ledger.pool_bytes == 8 * MIB
    assert ledger.used == device_used(be) == 14 * MIB
    # Met again: captured again on that call (no eager first call), 1 now the oldest.
    call(r, step, 2, 2)
    before = captures(be)
    call(r, step, 7)
    st = r.stats()
    assert captures(be) == [*before, 8] and r.captured_sizes == (2, 4, 8)
    row = st.size(8)
    assert (row.recaptures, row.warmup_calls, row.prewarmed, row.warmups) == (1, 1, True, 0)
    assert st.size(1).status == "evicted" and st.evictions == 2
    assert ledger.used == device_used(be) <= 15 * MIB
    # Hits: the replays; every call a replay but the first calls.
    assert st.replays == st.calls - 4 and st.hit_rate == st.replays / st.calls
    assert "2 evictions" in st.table() and "evicted 1x, recaptured 1x" in st.table()


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


def test_a_size_that_cannot_fit_alone_is_refused_and_evicts_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, step, be = make(12 * MIB)
    call(r, step, 1, 2)
    call(r, step, 4, 2)  # 4 + 2 * 2 = 8 MiB; two pool sizes: 1 MiB a row, nothing fixed
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        call(r, step, 16, 3)  # 16 MiB of pool alone: over 12 whatever goes
    st = r.stats()
    assert st.size(16).status == "over budget" and st.evictions == 0
    assert r.captured_sizes == (1, 4) and 16 not in captures(be)  # refused on the prediction
    assert any("over budget" in m and "16" in m for m in caplog.messages)


def test_evicting_the_pools_last_graph_gives_the_pool_back() -> None:
    """A capture that fits only in a fresh pool: every graph goes, the pool with them
    (the ledger back at zero), and the new graph starts a pool of its own."""
    r, step, _ = make(12 * MIB)
    call(r, step, 1, 2)  # 1 + 2
    call(r, step, 8, 2)  # 8 + 4 = 12 MiB
    call(r, step, 9, 2)  # 16: 16 + 2 = 18 over even alone: refused, nothing evicted
    assert r.stats().evictions == 0 and r.captured_sizes == (1, 8)
    r2, step2, be2 = make(11 * MIB)
    call(r2, step2, 1, 2)  # 1 + 2 = 3 MiB
    call(r2, step2, 2, 2)  # 2 + 4 = 6 MiB
    call(r2, step2, 8, 2)  # predicted 8 + 6 = 14: both go, pool too; then 8 + 2 = 10
    st = r2.stats()
    assert r2.captured_sizes == (8,) and st.evictions == 2
    assert r2.door.ledger.used == device_used(be2) == 10 * MIB


def test_a_blind_capture_over_the_budget_alone_is_dropped_and_the_pool_given_back() -> None:
    """One pool size known: a larger size is captured on that and checked after. Over
    even with every other graph gone (the pool keeps its blocks while the new graph holds
    it), the new graph is dropped; the pool it grew stays over the budget while any graph
    holds it, so with ``evict`` the others go and take it along: within the budget again,
    and the next meeting of each captures it warm. Without ``evict`` (refused, as
    before), the pool's blocks stay counted over the budget."""
    r, step, be = make(12 * MIB)
    call(r, step, 4, 2)
    call(r, step, 1, 2)  # 4 + 2 * 2 = 8 MiB; one pool size known (4)
    call(r, step, 16, 2)  # captured on a guess: 16 + 6 = 22, over even alone: dropped
    st = r.stats()
    assert st.size(16).status == "over budget" and captures(be)[-1] == 16
    assert r.captured_sizes == () and st.evictions == 2
    assert r.door.ledger.used == device_used(be) == 0
    call(r, step, 3)  # 4 again: captured at once (its shape ran), alone 4 + 2
    assert r.captured_sizes == (4,) and r.stats().size(4).recaptures == 1
    r2, step2, be2 = make(12 * MIB, evict=None)
    call(r2, step2, 4, 2)
    call(r2, step2, 1, 2)
    call(r2, step2, 16, 2)
    assert r2.captured_sizes == (1, 4) and r2.stats().size(16).status == "over budget"
    assert r2.door.ledger.used == device_used(be2) == 16 * MIB + 4 * MIB


def test_a_capture_that_took_more_than_predicted_evicts_others_not_itself() -> None:
    def superlinear(label: Any) -> tuple[int, int]:
        return (20 if int(label) == 4 else int(label)) * MIB, 2 * MIB

    be = gg.RecordingBackend(graph_bytes=superlinear)
    r, step, _ = make(26 * MIB, backend=be)
    call(r, step, 2, 2)  # 2 + 2
    call(r, step, 1, 2)  # + 2 = 6
    call(r, step, 3, 2)  # 4 predicted +2 pool +2 driver; took +18 +2 = 26... fits
    call(r, step, 2)
    call(r, step, 3)
    assert r.captured_sizes == (1, 2, 4)
    r2, step2, _ = make(25 * MIB, backend=gg.RecordingBackend(graph_bytes=superlinear))
    call(r2, step2, 2, 2)
    call(r2, step2, 1, 2)
    call(r2, step2, 3, 2)  # took 20 + 6 = 26 > 25: 2, the least recent, goes; 4 stays
    st = r2.stats()
    assert r2.captured_sizes == (1, 4) and st.size(2).status == "evicted"
    assert r2.door.ledger.used <= 25 * MIB


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
    r, step, _ = make(15 * MIB)
    for n in (8, 1, 2):
        call(r, step, n, 2)
    call(r, step, 4, 2)  # evicts 8
    assert r.stats().size(8).status == "evicted"
    assert r.capture_for(8) == 8 and r.captured_sizes == (2, 4, 8)
    (buf,) = r.static_inputs(8)
    x = torch.randn(8, 8)
    buf.copy_(x)
    torch.testing.assert_close(r.replay(8), x @ step.w + 1)


class KeepsSome(gg.RecordingBackend):
    """A driver that keeps a quarter of each destroyed graph's share (as the H200's kept
    part of a released ladder's): free memory shows only three quarters come back."""

    def _graph_freed(self, graph: Any) -> None:
        super()._graph_freed(graph)
        self._driver += graph.driver // 4


def test_what_the_driver_keeps_of_an_evicted_graph_stays_counted() -> None:
    be = KeepsSome(graph_bytes=graph_bytes)
    r, step, _ = make(15 * MIB, backend=be)
    for n in (8, 1, 2):
        call(r, step, n, 2)  # 8 + 3 * 2 = 14 MiB
    call(r, step, 3, 2)  # 16 predicted: 8 goes, 1.5 MiB of its 2 come back
    ledger = r.door.ledger
    st = r.stats()
    assert st.evictions == 1 and ledger.driver_adjust == MIB // 2
    assert ledger.used == device_used(be) == 14 * MIB + MIB // 2
    assert "+ 0.5 MiB kept after evictions" in st.table() and st.driver_adjust_bytes == MIB // 2


class KeepsASegment(gg.RecordingBackend):
    """A released pool that keeps one 2 MiB segment mapped (as a live block in it would,
    on CUDA): free memory shows the rest come back."""

    def empty_cache(self) -> None:
        gone = [p for p, held in self._pools.items() if held[1] <= 0]
        super().empty_cache()
        self.kept = getattr(self, "kept", 0) + 2 * MIB * len(gone)
        self._driver += 2 * MIB * len(gone)


def test_what_a_released_pool_keeps_mapped_stays_counted() -> None:
    be = KeepsASegment(graph_bytes=lambda label: ((32 + int(label)) * MIB, 2 * MIB))
    r, step, _ = make(43 * MIB, backend=be)
    call(r, step, 8, 2)  # 40 + 2 = 42 MiB
    call(r, step, 1, 2)  # 44 predicted: 8 goes with the pool, 2 MiB of which stays; 33 + 2
    ledger = r.door.ledger
    assert r.captured_sizes == (1,) and r.stats().evictions == 1 and be.kept == 2 * MIB
    assert ledger.driver_adjust == 2 * MIB
    assert ledger.used == device_used(be) == 37 * MIB
    assert "+ 2.0 MiB kept after evictions" in r.stats().table()


def test_a_dropped_capture_whose_pool_keeps_a_segment_stays_counted() -> None:
    """Refusing (no eviction): a capture over the budget is dropped, and the pool with it;
    what the pool kept mapped is still device memory the graphs took."""
    be = KeepsASegment(graph_bytes=lambda label: ((32 + int(label)) * MIB, 2 * MIB))
    r, step, _ = make(30 * MIB, evict=None, backend=be)
    call(r, step, 1, 2)  # its capture takes 33 + 2: dropped, the pool goes, 2 MiB stays
    st = r.stats()
    assert r.captured_sizes == () and st.size(1).status == "over budget"
    assert r.door.ledger.used == device_used(be) == r.door.ledger.driver_adjust == 2 * MIB


def test_a_fresh_pool_predicts_from_the_largest_pool_learned() -> None:
    """A pool's fixed part (on CUDA: the cuBLAS workspace each pool holds) spread over one
    row would make every larger size look hopeless; the per-row learned at the largest
    size spreads it over that size's rows."""
    be = gg.RecordingBackend(graph_bytes=lambda label: ((32 + int(label)) * MIB, 2 * MIB))
    r, step, _ = make(43 * MIB, backend=be)
    call(r, step, 8, 2)  # 40 + 2 = 42 MiB
    call(r, step, 1, 2)  # 44 predicted: 8 goes, and the pool with it; then 33 + 2
    assert r.captured_sizes == (1,) and r.stats().evictions == 1
    call(r, step, 2, 2)  # predicted from 40 MiB / 8 rows: fits beside 1 (34 + 4 = 38)
    assert r.captured_sizes == (1, 2) and r.stats().evictions == 1
    assert r.door.ledger.used == device_used(be) == 38 * MIB


def test_two_pools_tell_the_fixed_part_from_the_rows() -> None:
    """A first capture into a fresh pool at 1 row (33 MiB) and the pool at 8 rows (40 MiB)
    tell the fixed part (32) from the bytes per row (1): size 16 alone takes 48 + 2 = 50,
    within the budget, where bytes per row alone (5 MiB a row at 8) would call it hopeless.
    """
    be = gg.RecordingBackend(graph_bytes=lambda label: ((32 + int(label)) * MIB, 2 * MIB))
    r, step, _ = make(50 * MIB, backend=be)
    call(r, step, 1, 2)  # 33 + 2
    call(r, step, 8, 2)  # the pool grows to 40: + 2 = 44
    assert r.captured_sizes == (1, 8) and r.door.ledger.used == 44 * MIB
    assert r.door.ledger.predict_alone(16) == 50 * MIB
    call(r, step, 12, 2)  # 16: 1 and 8 go, the pool with them; 16 alone fits
    assert r.captured_sizes == (16,) and r.stats().evictions == 2
    assert r.door.ledger.used == device_used(be) == 50 * MIB


def test_door_evict_is_drop_size_with_evict_and_the_old_spelling_warms_one_release() -> None:
    """``door.drop_size(size, evict=True)`` releases a size to make room (counted, captured
    again when met); 0.4's ``door.evict(size)`` still does it, with a DeprecationWarning
    naming the new spelling."""
    r, step, _ = make(64 * MIB)
    for n in (1, 2, 4):
        call(r, step, n, 2)
    r.door.drop_size(1, evict=True)
    assert 1 not in r.captured_sizes and r.stats().size(1).evictions == 1
    with pytest.warns(
        DeprecationWarning, match=r"^graphguard\.door\.evict.*drop_size\(size, evict=True\)"
    ):
        r.door.evict(2)  # type: ignore[attr-defined]
    assert 2 not in r.captured_sizes
    call(r, step, 2, 2)  # met again: its first call, then captured again
    assert 2 in r.captured_sizes
