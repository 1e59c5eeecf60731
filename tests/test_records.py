"""One record per captured size (``graphguard.ladder.record``): after every way graphs come
and go -- a capture up front, a lazy capture, a partial recapture (sizes, or PIECEWISE
pieces alone), a dropped size, a failed size, a release, a full recapture -- the ledger,
the weight records, provenance's reads, ``stats()`` and the refusals tell the same story,
because they all read the store's one record per size instead of keeping their own."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend

MIB = 1 << 20


class Derived(torch.nn.Module):
    """A weight and a tensor derived from it at load (``wt``), both read by every graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.rederive()

    def rederive(self) -> None:
        self.wt = self.lin.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wt + self.lin(x)


def backend() -> RecordingBackend:
    """Emulated device memory: a capture of size n grows the pool to n MiB and holds one
    MiB of driver memory, so the ledger has bytes to agree on."""
    return RecordingBackend(graph_bytes=lambda label: (int(label) * MIB, MIB))


def build(model: torch.nn.Module | None = None, **kw) -> gg.GraphRunner:
    kw.setdefault("sizes", [1, 2, 4, 8])
    return gg.GraphRunner(
        model or Derived(), (torch.zeros(2, 4),), backend=kw.pop("backend", backend()),
        provenance=True, progress=False, state=[], **kw,
    )  # fmt: skip


def facts(r: gg.GraphRunner) -> dict[str, object]:
    """Every view of "which sizes have a graph", and the refusals."""
    stats = r.stats()
    return {
        "held": tuple(r.captured_sizes),
        "ledger pool": tuple(sorted(r.door.ledger.pool)),
        "ledger driver": tuple(sorted(r.door.ledger.driver)),
        "weight records": tuple(sorted(r._store.weight_records())),
        "reads": tuple(sorted({g.size for g in r.audit().graphs})),
        "stats captured": tuple(s.size for s in stats.sizes if s.status == "captured"),
        "stats refused": tuple(
            s.size for s in stats.sizes if s.status in ("failed", "over budget")
        ),
        "refusals": tuple(sorted(r.door.refusals)),
    }


def assert_agree(r: gg.GraphRunner, held: tuple[int, ...], refused: tuple[int, ...] = ()) -> None:
    f = facts(r)
    for view in (
        "held",
        "ledger pool",
        "ledger driver",
        "weight records",
        "reads",
        "stats captured",
    ):
        assert f[view] == held, (view, f)
    assert f["stats refused"] == f["refusals"] == refused, f
    assert r.door.ledger.driver_bytes == MIB * len(held)


def test_a_capture_up_front_makes_one_record_per_size_every_view_agrees() -> None:
    r = build()
    r.capture()
    assert_agree(r, (1, 2, 4, 8))
    assert set(r._store.records) == {1, 2, 4, 8}
    rec = r._store.records[8]
    assert rec.how == "up front" and rec.reads and not rec.unread and rec.weights is not None


def test_a_lazy_capture_adds_one_record_and_the_views_follow() -> None:
    r = build(lazy=gg.Lazy(capture_now=[8]))
    r.capture()
    assert_agree(r, (8,))
    r(torch.randn(3, 4))  # size 4's first call: its warmup, eagerly (graphguard.lazy)
    assert_agree(r, (8,))
    r(torch.randn(3, 4))  # its capture
    assert_agree(r, (4, 8))
    assert r._store.records[4].how == "lazily"


def test_a_dropped_size_leaves_every_view_and_its_driver_share_goes_back() -> None:
    r = build()
    r.capture()
    pool = r.door.ledger.pool_bytes
    r.door.drop_size(2)
    assert_agree(r, (1, 4, 8))
    assert r.door.ledger.pool_bytes == pool  # its blocks stay in the pool, counted as dropped
    torch.testing.assert_close(r(torch.ones(2, 4)), r.eager(torch.ones(2, 4)))  # pads to 4


def test_a_failed_size_is_refused_and_has_no_record() -> None:
    be = backend()
    be.fail_on.add(4)
    r = build(backend=be, options=gg.CaptureOptions(on_capture_error="skip"))
    r.capture()
    assert_agree(r, (1, 2, 8), refused=(4,))


def test_release_empties_every_view_and_a_recapture_fills_them_again() -> None:
    be = backend()
    be.fail_on.add(4)
    r = build(backend=be, options=gg.CaptureOptions(on_capture_error="skip"))
    r.capture()
    r.release()
    assert_agree(r, ())
    assert r.door.ledger.used == 0
    be.fail_on.clear()
    r.capture()
    assert_agree(r, (1, 2, 4, 8))
    r.recapture(reason="config changed")
    assert_agree(r, (1, 2, 4, 8))


def test_a_partial_recapture_replaces_the_records_of_the_sizes_it_redid() -> None:
    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.Parameter(torch.randn(4, 4))
            self.big = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ (self.small if x.shape[0] <= 2 else self.big)

    m = Split()
    r = build(m)
    r.capture()
    before = {s: r._store.records[s] for s in (1, 2, 4, 8)}
    m.big.data = torch.randn(4, 4)  # moved: the graphs of 4 and 8 read the old storage
    report = r.recapture(reason="big reloaded", only_moved=True)
    assert sorted(report.captured) == [4, 8]
    assert report.recaptured_graphs == [(4, None), (8, None)] and report.graphs_total == 4
    assert_agree(r, (1, 2, 4, 8))
    after = r._store.records
    assert after[1] is before[1] and after[2] is before[2]  # kept as they were
    assert after[4] is not before[4] and after[8] is not before[8]
    assert r.check_weights().ok
    x = torch.randn(8, 4)
    torch.testing.assert_close(r(x), m(x))


def test_derived_reads_are_per_graph_a_graph_captured_after_a_rederive_is_not_named() -> None:
    """The outside case: a derived tensor re-created between two captures. The older graphs
    read the old storage (named stale); the graph captured after reads the live one (not
    named): check_weights and audit agree graph by graph."""
    m = Derived()
    r = build(m, lazy=gg.Lazy(capture_now=[8]))
    r.capture()
    m.rederive()  # a new address: the size-8 graph reads the old one
    r(torch.randn(3, 4))  # size 4's first call (its warmup) ...
    r(torch.randn(3, 4))  # ... and its capture, over the new one
    found = r.check_weights()
    stale = [w for w in found.moved if w.name == "wt"]
    assert stale and stale[0].graphs == ((8, None),) and stale[0].sizes == (8,)
    audit = r.audit()
    assert [keys for name, _, keys in audit.stale if name == "wt"] == [((8, None),)]
    assert set(audit.reading("wt")) == {(4, None), (8, None)}


@pytest.mark.compile
def test_capture_pieces_counts_the_graphs_it_redid_of_the_graphs_held() -> None:
    """A PIECEWISE partial recapture called directly reports ``graphs_total`` as a
    recapture does, and keeps the other pieces' reads on the size's record."""
    torch._dynamo.reset()
    from tests.test_piecewise import batch, make

    r, model = make(provenance=True, sizes=[2, 4])
    r.capture()
    for n in (2, 4):
        r(*batch(n, seed=n))
    total = len(r.door.graph_keys)
    r.audit()  # provenance reads a graph on the first question
    reads_before = dict(r._store.records[4].reads)
    report = r.capture_pieces({4: [1]})
    assert report.graphs_total == total == 6
    assert report.recaptured_graphs == [(4, 1)]
    r.audit()
    reads_after = r._store.records[4].reads
    assert set(reads_after) == set(reads_before) == {(4, 0), (4, 1), (4, 2)}
    assert reads_after[(4, 0)] is reads_before[(4, 0)]  # not redone: the same proof
    assert reads_after[(4, 1)] is not reads_before[(4, 1)]
    torch.testing.assert_close(r(*batch(4, seed=9)), model(*batch(4, seed=9)))
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize(
    ("graphs", "fragment"),
    [
        ({4: [7]}, "no piece [7]"),
        ({99: [0]}, "size 99 is not captured"),
        ([4], "mapping of captured size -> piece indices"),
        ({4: []}, "no piece named"),
    ],
)
def test_capture_pieces_refuses_what_it_cannot_do_naming_it(graphs, fragment) -> None:
    torch._dynamo.reset()
    from tests.test_piecewise import make

    r, _ = make(sizes=[2, 4])
    r.capture()
    with pytest.raises(gg.errors.ConfigError, match=r"capture_pieces") as e:
        r.capture_pieces(graphs)
    assert fragment in str(e.value)
    torch._dynamo.reset()


def test_the_weights_kept_record_holds_no_tensor_alive() -> None:
    """``Weights.take`` keeps its last record and the module's identity for reuse (a lazy
    capture's record in microseconds); neither may keep a replaced weight's memory alive
    (the sanitizer then names a reload's freed storage, H200: test_1c), and the reuse
    ends when a tensor is replaced."""
    import gc
    import weakref

    from graphguard.weights.record import Weights

    m = torch.nn.Linear(4, 4)
    room = Weights("r", m)
    first = room.take()
    assert room.take() is first and room.unchanged_since_last()
    old = weakref.ref(m.weight)
    m.weight = torch.nn.Parameter(torch.randn(4, 4))
    gc.collect()
    assert old() is None, "the kept identity holds the replaced weight alive"
    assert not room.unchanged_since_last()
    assert room.take() is not first
    m.bias = None  # removed, its tensor freed: changed, not a crash
    room.take()
    gc.collect()
    del m._parameters["weight"]
    gc.collect()
    assert not room.unchanged_since_last()
