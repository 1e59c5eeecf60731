"""Graph provenance on the CPU (issue 30): ``RecordingBackend(provenance=True)`` records
which storages each emulated graph reads, so every rule has a CPU test: exact
``graph_reads()``, ``check_weights`` naming the graphs, partial recapture, derived
tensors (listed, update refused without ``refresh``), the capture-time refusal of a
graph that takes freed memory, ``audit()``, the interval search and its cost, and the
one-time "no cuda-bindings" fallback. PIECEWISE: a moved weight recaptures only the
pieces that read it (counted, the other graph objects kept, outputs equal eager), a size
whole when every piece reads it, every piece without provenance, a failed piece drops
its size; FULL_AND_PIECEWISE through the dispatcher."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

import graphguard as gg
from graphguard import _graph_args
from graphguard._demangle import OPAQUE, POINTER
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, FreedStorageError, GraphCaptureError, WeightsMovedError
from graphguard.provenance import (
    KEEP,
    GraphProvenance,
    Owner,
    Owners,
    Provenance,
    Word,
    classify,
)


class Branchy(torch.nn.Module):
    """Batches up to 2 read ``small``, larger ones ``big``: a Python branch on the shape,
    so each size's graph reads one of them (what provenance must tell apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Parameter(torch.randn(4, 4))
        self.big = torch.nn.Parameter(torch.randn(4, 4))
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.small if x.shape[0] <= 2 else self.big
        return x @ w + self.bias


class Derived(torch.nn.Module):
    """The issue's example: ``wt`` derived from the weight at load, read by the graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.rederive()

    def rederive(self) -> None:
        """At a new address, as engines' post-load processing does."""
        self.wt = self.lin.weight.detach().t().contiguous()

    def rederive_in_place(self) -> None:
        with torch.no_grad():
            self.wt.copy_(self.lin.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wt + self.lin.bias


def runner(model: torch.nn.Module, *, provenance: bool | None = True, **kw) -> gg.GraphRunner:
    kw.setdefault("sizes", [1, 2, 4, 8])
    backend = kw.pop("backend", RecordingBackend())
    return gg.GraphRunner(
        model, (torch.zeros(2, 4),), backend=backend, provenance=provenance, progress=False, **kw
    )


def captures(backend: RecordingBackend) -> list[int]:
    return [e[1] for e in backend.events if e[0] == "capture_end"]


# ------------------------------------------------------------------ exact reads


def test_graph_reads_are_exact_per_size_and_name_the_owners() -> None:
    m = Branchy()
    r = runner(m)
    r.capture()
    reads = {g.size: {x.start for x in g.reads} for g in r.audit().graphs}
    assert set(reads) == {1, 2, 4, 8}
    small, big = m.small.data_ptr(), m.big.data_ptr()
    assert all(small in reads[s] and big not in reads[s] for s in (1, 2))
    assert all(big in reads[s] and small not in reads[s] for s in (4, 8))
    audit = r.audit()
    assert audit.enabled and len(audit.graphs) == 4
    assert audit.reading("big") == ((4, None), (8, None))
    assert audit.reading("bias") == ((1, None), (2, None), (4, None), (8, None))
    kinds = {x.name: x.kind for g in audit.graphs for x in g.reads}
    assert kinds["small"] == "parameter" and "static input" in kinds.values()
    text = str(audit)
    # Graphs reading the same owners are one group; each kind names what it reads.
    assert "sizes 4,8 (2 graphs)" in text and "sizes 1,2 (2 graphs)" in text
    assert "parameter (2): bias, big" in text and "static input (1): input[0]" in text


def test_a_moved_weight_names_only_the_graphs_that_read_it_and_recaptures_only_those() -> None:
    m = Branchy()
    backend = RecordingBackend()
    r = runner(m, backend=backend)
    r.capture()
    m.big.data = torch.randn(4, 4)  # the `.data =` rebind: a new storage
    found = r.check_weights()
    assert [x.name for x in found.moved] == ["big"]
    assert found.sizes == (4, 8) and found.reads_known
    before = len(captures(backend))
    report = r.recapture(reason="big reloaded", only_moved=True)
    assert sorted(captures(backend)[before:]) == [4, 8]  # counted: two graphs, not four
    assert report.recaptured_graphs == [(4, None), (8, None)] and report.graphs_total == 4
    assert found.graphs == ((4, None), (8, None))
    assert r.check_weights().ok
    assert r.audit().stale == ()


@pytest.mark.parametrize(
    ("how", "keep", "what"),
    [
        ("data", True, "replaced or moved; the graph reads the old storage"),
        ("parameter", True, "replaced or moved; the graph reads the old storage"),
        ("data", False, "freed"),
    ],
    ids=["data-kept", "parameter-kept", "data-dropped"],
)
def test_audit_names_a_rebound_parameter_stale_right_after_the_rebind(
    how: str, keep: bool, what: str
) -> None:
    """Before any recapture or check: a parameter rebound after capture (``.data =``, or a
    new ``nn.Parameter`` assigned) is listed by ``audit().stale`` with exactly the graphs
    that read it (the old storage kept alive: replaced; dropped: freed); the parameters not
    rebound are not listed."""
    m = Branchy()
    r = runner(m)
    r.capture()
    assert r.audit().stale == ()
    old = m.big.detach() if keep else None
    new = torch.randn(4, 4)
    if how == "data":
        m.big.data = new
    else:
        m.big = torch.nn.Parameter(new)
    audit = r.audit()
    assert audit.stale == (("big", what, ((4, None), (8, None))),)
    assert f"STALE big: {what}; read by sizes 4,8 (2 graphs)" in str(audit)
    del old


def test_update_weights_recapture_touches_only_the_graphs_that_read_what_moved() -> None:
    m = Branchy()
    backend = RecordingBackend()
    r = runner(m, backend=backend)
    r.capture()
    before = len(captures(backend))

    def loader() -> None:
        m.small = torch.nn.Parameter(torch.randn(4, 4))  # a module attribute replaced

    done = r.update_weights(loader, on_moved="recapture", strict=False)
    assert done.recaptured == {r.label: (1, 2)}
    assert sorted(captures(backend)[before:]) == [1, 2]
    assert done.recaptured_graphs == {r.label: ((1, None), (2, None))}
    assert done.graphs_total == {r.label: 4} and "(2 of 4 graphs)" in done.summary()
    x = torch.randn(2, 4)
    torch.testing.assert_close(r(x), m(x))


def test_without_provenance_reads_stay_unknown_and_every_size_recaptures() -> None:
    m = Branchy()
    r = runner(m, provenance=None)  # the CPU emulation records reads only when asked
    r.capture()
    assert not r.audit().enabled and "provenance=True" in r.audit().table()
    assert r.audit().graphs == () and not r.check_weights().reads_known
    m.big.data = torch.randn(4, 4)
    assert r.check_weights().sizes == (1, 2, 4, 8)


def test_provenance_flag_is_validated() -> None:
    with pytest.raises(ConfigError, match="provenance"):
        runner(Branchy(), provenance="yes")  # type: ignore[arg-type]


def test_the_environment_turns_provenance_on_for_runners_that_left_it_unset(monkeypatch) -> None:
    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "1")
    on, off = runner(Branchy(), provenance=None), runner(Branchy(), provenance=False)
    on.capture()
    off.capture()
    assert on.audit().enabled and len(on.audit().graphs) == 4
    assert not off.audit().enabled and "provenance=False" in off.audit().why
    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "maybe")
    with pytest.raises(ConfigError, match="GRAPHGUARD_PROVENANCE='maybe'"):
        runner(Branchy(), provenance=None).capture()


@pytest.mark.compile
def test_the_environment_switch_reaches_piecewise_runners_and_graphed_causal_lm(
    monkeypatch, fresh_dynamo
) -> None:
    """One meaning for every runner kind: GRAPHGUARD_PROVENANCE turns provenance on where
    ``provenance`` is left unset (PiecewiseRunner's pieces, GraphedCausalLM's runner), and
    ``provenance=False`` still wins."""
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "on")
    r, _ = piecewise(provenance=None)
    assert r.audit().enabled and r.audit().graphs
    off, _ = piecewise(provenance=False)
    assert not off.audit().enabled
    g = GraphedCausalLM(
        F.model("llama"), max_batch=2, max_cache_len=16, backend=RecordingBackend(), progress=False
    )
    g.capture()
    assert g.runner.audit().enabled and g.runner.audit().graphs


# ------------------------------------------------------------------ derived tensors


def test_derived_tensor_is_listed_by_audit_and_check_weights() -> None:
    r = runner(Derived())
    r.capture()
    assert r.audit().derived == ("wt",)
    found = r.check_weights()
    assert found.ok and found.derived == ("wt",)


def test_update_refused_while_graphs_read_a_derived_tensor_without_refresh() -> None:
    m = Derived()
    r = runner(m)
    r.capture()
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    w0 = m.lin.weight.clone()
    with pytest.raises(ConfigError, match=r"derived at load\): wt"):
        r.update_weights(new)
    torch.testing.assert_close(m.lin.weight, w0)  # refused before anything was copied


def test_the_issues_reload_is_caught_a_rederived_tensor_moved() -> None:
    """update_weights then the load hook re-deriving wt at a new address: before
    provenance check_weights reported nothing moved, and every graph read the old wt."""
    m = Derived()
    r = runner(m)
    r.capture()
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    with pytest.raises(WeightsMovedError, match="wt") as err:
        r.update_weights(new, refresh=m.rederive)
    assert err.value.names == ("wt",)
    found = r.check_weights()
    assert [x.name for x in found.moved] == ["wt"] and found.sizes == (1, 2, 4, 8)
    assert [s[0] for s in r.audit().stale] == ["wt"]


def test_refresh_in_place_keeps_the_graphs_and_serves_the_new_weights() -> None:
    m = Derived()
    r = runner(m)
    r.capture()
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    done = r.update_weights(new, refresh=m.rederive_in_place)
    assert done.recaptured == {} and r.check_weights().ok
    x = torch.randn(3, 4)
    torch.testing.assert_close(r(x), x @ new["lin.weight"].t() + new["lin.bias"])


def test_refresh_at_a_new_address_recaptures_the_graphs_that_read_it() -> None:
    m = Derived()
    backend = RecordingBackend()
    r = runner(m, backend=backend, sizes=[1, 2])
    r.capture()
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    done = r.update_weights(new, refresh=m.rederive, on_moved="recapture")
    assert done.recaptured == {r.label: (1, 2)}
    assert r.check_weights().ok


def test_refresh_must_be_callable() -> None:
    r = runner(Derived())
    r.capture()
    with pytest.raises(ConfigError, match="refresh must be a callable"):
        r.update_weights({}, refresh=1, strict=False)  # type: ignore[arg-type]


# ------------------------------------------------------------------ refused at capture


class FreesWhileCaptured(torch.nn.Module):
    """Reads a cached tensor, then drops the cache inside the captured step: the graph
    holds the address of memory nobody owns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(4, 4)
        y = self.lin(x) @ self.cache
        if gg.phase.is_capturing():
            self.cache = None  # freed, while the graph keeps its address
        return y


def test_a_graph_taking_freed_memory_is_refused_when_captured() -> None:
    r = runner(FreesWhileCaptured(), sizes=[2], sanitize=True)
    with torch.no_grad(), pytest.raises((GraphCaptureError, FreedStorageError)) as err:
        r.capture()  # (no_grad: autograd would keep the cache alive)
    cause = getattr(err.value, "cause", err.value)
    assert isinstance(cause, FreedStorageError)
    assert "size 2" in str(cause) and "mm" in str(cause) and "before any replay" in str(cause)
    assert r.captured_sizes == ()


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = FreesWhileCaptured()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("model", [FreesWhileCaptured, Nested])
def test_a_freed_module_attribute_is_named_as_the_last_owner(model: type) -> None:
    """The sanitizer's refusal names the attribute that held the memory (it said "owner
    never known": every walk of the module ran after the step dropped it)."""
    r = runner(model(), sizes=[2], sanitize=True)
    with torch.no_grad(), pytest.raises((GraphCaptureError, FreedStorageError)) as err:
        r.capture()
    cause = getattr(err.value, "cause", err.value)
    assert isinstance(cause, FreedStorageError)
    path = "cache" if model is FreesWhileCaptured else "inner.cache"
    assert f"taken by mm.default, last owned by {path}\n" in str(cause)
    assert "never known" not in str(cause)


def test_an_arenas_replaced_buffer_is_refused_when_captured() -> None:
    ws = gg.Workspace("scratch", "cpu")

    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.view: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.view is None:  # a view of the arena cached on first use: the bug
                (self.view,) = ws.get(((4,), torch.float32))
            return self.lin(x) + self.view

    m = Cached()
    r = runner(m, sizes=[2], workspaces=[ws], sanitize=True)
    r.capture()
    with ws.unlocked(reason="test: grow"):
        ws.reserve(1 << 16)  # a new buffer; m.view keeps the old one alive
    with pytest.raises((GraphCaptureError, FreedStorageError)) as err:
        r.recapture(reason="test", only_moved=False)
    cause = getattr(err.value, "cause", err.value)
    assert isinstance(cause, FreedStorageError)
    assert "last owned by arena scratch" in str(cause)


# ------------------------------------------------------------------ PIECEWISE


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


SIZES_PW = [1, 2, 4, 8]


def piecewise(**kw):
    """``tests.test_piecewise``'s Tiny (3 pieces: piece 0 reads embed and q.0, piece 1
    o.0 and q.1, piece 2 o.1; the split op reads mem), captured, every size replayed once
    (a piece checks its inputs' addresses on its first replay)."""
    from tests.test_piecewise import batch, make

    kw.setdefault("provenance", True)
    kw.setdefault("sizes", SIZES_PW)
    r, model = make(**kw)
    r.capture()
    for n in r.captured_sizes:
        torch.testing.assert_close(r(*batch(n, seed=n)), model(*batch(n, seed=n)))
    return r, model


def piece_graphs(r) -> dict[tuple[int, int], object]:
    return {(s, p.index): p.graph_at(s) for p in r.pieces for s in p.captured_sizes}


def replace(model, name: str) -> None:
    """A module attribute replaced (a new Parameter object): the emulated graphs keep
    reading the old one, as CUDA graphs keep reading the old address."""
    kind, i = name.split(".")
    getattr(model, kind)[int(i)] = torch.nn.Parameter(torch.randn(8, 8) * 0.3)


def equals_eager(r, model) -> None:
    from tests.test_piecewise import batch

    for n in range(1, 9):
        x = batch(n, seed=100 + n)
        torch.testing.assert_close(r(*x), model(*x), msg=lambda m, n=n: f"batch {n}: {m}")


@pytest.mark.compile
def test_piecewise_each_piece_reads_its_own_weights(fresh_dynamo) -> None:
    from tests.test_piecewise import make

    r, model = make(provenance=True, sizes=[2, 4])
    r.capture()
    audit = r.audit()
    assert {g.piece for g in audit.graphs} == {0, 1, 2}
    # q.0 is read by piece 0 of each size, o.1 by the last piece only.
    assert audit.reading("q.0") == ((2, 0), (4, 0))
    assert audit.reading("o.1") == ((2, 2), (4, 2))
    assert audit.reading("mem") == ()  # read by the split op alone, eagerly
    backend = r.backend
    before = len(captures(backend))  # type: ignore[arg-type]
    model.o[1].data = torch.randn_like(model.o[1])
    found = r.check_weights()
    assert [x.name for x in found.moved] == ["o.1"] and found.graphs == ((2, 2), (4, 2))
    report = r.recapture(reason="o.1 reloaded", only_moved=True)
    # Only the piece that reads o.1, at each size: 2 graphs of 6.
    assert captures(backend)[before:] == [(4, 2), (2, 2)]  # type: ignore[arg-type]
    assert report.recaptured_graphs == [(2, 2), (4, 2)] and report.graphs_total == 6
    assert "recaptured 2 of 6 graphs" in report.summary()


@pytest.mark.compile
@pytest.mark.parametrize(("name", "piece"), [("q.0", 0), ("o.0", 1), ("o.1", 2)])
def test_piecewise_recaptures_only_the_pieces_that_read_a_moved_weight(
    fresh_dynamo, name, piece
) -> None:
    r, model = piecewise()
    backend = r.backend
    assert r.audit().reading(name) == tuple((s, piece) for s in SIZES_PW)
    graphs = piece_graphs(r)
    replace(model, name)
    from tests.test_piecewise import batch

    x = batch(3, seed=7)
    assert not torch.allclose(r(*x)[0], model(*x)[0])  # stale until recaptured
    found = r.check_weights()
    assert [m.name for m in found.moved] == [name]
    assert found.graphs == tuple((s, piece) for s in SIZES_PW)
    before = len(backend.events)  # type: ignore[attr-defined]
    done = r.update_weights(lambda: None, on_moved="recapture", strict=False)
    events = backend.events[before:]  # type: ignore[attr-defined]
    recaptured = [e[1] for e in events if e[0] == "capture_end"]
    print(done.summary(), recaptured)
    # Counted: one piece graph per size, of 12; the other pieces replayed in between.
    assert recaptured == [(s, piece) for s in sorted(SIZES_PW, reverse=True)]
    assert done.recaptured == {r.label: tuple(SIZES_PW)}
    assert done.recaptured_graphs == {r.label: tuple((s, piece) for s in SIZES_PW)}
    assert done.graphs_total == {r.label: 12} and "(4 of 12 graphs)" in done.summary()
    others = {(e[1]) for e in events if e[0] == "replay" and e[1][1] != piece}
    assert others == {(s, p) for s in SIZES_PW for p in range(3) if p != piece}
    after = piece_graphs(r)
    assert after.keys() == graphs.keys()
    for key, graph in graphs.items():  # the same graph objects, except the recaptured
        assert (after[key] is graph) == (key[1] != piece), key
    equals_eager(r, model)
    assert r.check_weights().ok and r.audit().stale == ()
    assert r.stats().size(8).status == "captured"


@pytest.mark.compile
def test_piecewise_two_moved_weights_recapture_their_two_pieces(fresh_dynamo) -> None:
    r, model = piecewise()
    replace(model, "q.0")
    replace(model, "o.1")
    report = r.recapture(reason="two reloaded", only_moved=True)
    assert report.recaptured_graphs == [(s, p) for s in SIZES_PW for p in (0, 2)]
    assert report.graphs_total == 12 and "recaptured 8 of 12 graphs" in report.summary()
    equals_eager(r, model)
    assert r.check_weights().ok


@pytest.mark.compile
def test_piecewise_a_weight_every_piece_reads_recaptures_whole_sizes(fresh_dynamo) -> None:
    """Named pieces covering every piece of a size: the size is recaptured whole, into
    the shared pool, in one forward where every piece captures (nothing replays)."""
    r, model = piecewise()
    backend = r.backend
    for name in ("q.0", "o.0", "o.1"):
        replace(model, name)
    before = len(backend.events)  # type: ignore[attr-defined]
    report = r.recapture(reason="all reloaded", only_moved=True)
    events = backend.events[before:]  # type: ignore[attr-defined]
    assert not [e for e in events if e[0] == "replay"]
    assert len(report.recaptured_graphs) == report.graphs_total == 12
    assert all(p.pool_at(s) == r._store.pool for p in r.pieces for s in p.captured_sizes)
    equals_eager(r, model)


@pytest.mark.compile
def test_piecewise_without_provenance_recaptures_every_piece_of_the_sizes(fresh_dynamo) -> None:
    r, model = piecewise(provenance=None)
    replace(model, "o.1")
    found = r.check_weights()
    assert found.sizes == tuple(SIZES_PW) and found.graphs == ()  # known per size only
    report = r.recapture(reason="o.1 reloaded", only_moved=True)
    assert len(report.recaptured_graphs) == report.graphs_total == 12
    equals_eager(r, model)


@pytest.mark.compile
def test_piecewise_a_piece_that_fails_to_recapture_drops_its_size_to_eager(fresh_dynamo) -> None:
    r, model = piecewise(options=gg.CaptureOptions(on_capture_error="skip"))
    r.backend.fail_on = {(4, 1)}  # type: ignore[attr-defined]
    replace(model, "o.0")
    report = r.recapture(reason="o.0 reloaded", only_moved=True)
    assert report.failed == [4] and r.captured_sizes == (1, 2, 8)
    assert report.recaptured_graphs == [(1, 1), (2, 1), (8, 1)]
    assert r.stats().size(4).status == "failed"
    assert {k[0] for k in piece_graphs(r)} == {1, 2, 8}
    equals_eager(r, model)  # batches 3 and 4 pad to 8
    assert r.check_weights().ok and r.audit().stale == ()


class _Piece:
    """What alone_or_whole asks of a piece: its graphs, their pools, whether alone is ok."""

    def __init__(self, index: int, pools: dict[int, str], aliased: tuple[int, ...] = ()):
        self.index, self.pools, self.aliased = index, pools, aliased

    def graph_at(self, size: int):
        return object() if size in self.pools else None

    def pool_at(self, size: int):
        return self.pools.get(size)

    def alone_ok(self, size: int) -> bool:
        return size in self.pools and size not in self.aliased


def test_alone_or_whole_rules() -> None:
    from graphguard.piecewise.pieces import alone_or_whole

    shared = {s: "shared" for s in (1, 2, 4, 8)}
    pieces = [
        _Piece(0, {**shared, 4: "other"}),  # size 4: recaptured alone before, elsewhere
        _Piece(1, shared, aliased=(8,)),  # size 8: an output shares an input's storage
        _Piece(2, shared),
    ]
    alone, whole = alone_or_whole(
        pieces, {1: [2], 2: [0, 1, 2], 4: [1, 2], 8: [1], 16: [0]}, (1, 2, 4, 8), "shared"
    )
    # 1: one piece alone; 2: every piece named; 4: none left in the shared pool;
    # 8: the named piece's output aliases; 16: not captured.
    assert alone == {1: frozenset({2})} and whole == [2, 4, 8]


@pytest.mark.compile
def test_full_and_piecewise_update_recaptures_full_sizes_and_piecewise_pieces(
    fresh_dynamo,
) -> None:
    from tests.test_piecewise import Tiny, batch

    model = Tiny()
    d = gg.build_dispatcher(
        model,
        batch(4),
        mode="full_and_piecewise",
        split_ops=[torch.ops.gg_test.attn],
        max_tokens=8,
        full_sizes=[1, 2, 4],
        piecewise_sizes=[2, 4, 8],
        backend_factory=RecordingBackend,
        fill_values=(0, 1.0),
        provenance=True,
        progress=False,
    )
    d.capture()
    full, pw = d.full, d.piecewise
    assert full is not None and pw is not None
    replace(model, "o.1")
    up = d.update_weights(lambda: None, on_moved="recapture", strict=False)
    print(up.summary())
    assert up.recaptured_graphs == {
        full.label: ((1, None), (2, None), (4, None)),
        pw.label: ((2, 2), (4, 2), (8, 2)),
    }
    assert up.graphs_total == {full.label: 3, pw.label: 9}
    assert all(c.ok for c in d.check_weights().values())
    for n in (1, 3, 4):
        torch.testing.assert_close(full(*batch(n)), model(*batch(n)))
    for n in (2, 5, 8):
        torch.testing.assert_close(pw(*batch(n)), model(*batch(n)))


# ------------------------------------------------------------------ the search itself


def _args(words: list[int], **spans) -> _graph_args.GraphArgs:
    return _graph_args.GraphArgs(
        words=torch.tensor(words, dtype=torch.int64),
        kernel=torch.arange(len(words), dtype=torch.int64),
        kernels=[f"k{i}" for i in range(len(words))],
        **spans,
    )


def test_classify_sorts_words_into_owners_pool_unknown_unowned_and_noise() -> None:
    owners = Owners([Owner("w", "parameter", 1000, 2000), Owner("kv", "state", 5000, 6000)])
    history = Owners([Owner("old", "parameter", 9000, 9100)])
    args = _args(
        [1500, 1999, 5000, 3100, 7100, 8100, 9050, 64, 12],
        pool=[(3000, 3200)],
        live=[(7000, 7200)],
        freed=[(8000, 8200)],
    )
    gp = classify(args, owners, history, 4, None)
    assert [(x.name, x.words, x.kernel) for x in gp.reads] == [("w", 2, "k0"), ("kv", 1, "k2")]
    assert gp.temporaries == 1
    assert [(w.address, w.kernel, w.nbytes) for w in gp.unknown] == [(7100, "k4", 200)]
    assert [(w.address, w.last_owner) for w in gp.unowned] == [(8100, None), (9050, "old")]


def _kinds(*kinds: int) -> torch.Tensor:
    return torch.tensor(kinds, dtype=torch.uint8)


def test_every_word_into_freed_memory_is_decided_or_named_undecided() -> None:
    """A launch copies whole structs whose unset fields hold stale host-stack bytes, so a
    word inside an opaque argument (a closure, a struct no name lays out) is no proof of a
    read, and no proof of none. Decided: a pointer by the kernel's types (unowned when its
    memory is freed); an opaque word into memory free as the capture began (no launch in
    it took that memory: dismissed). Left: undecided, with why, never stale or dropped."""
    history = Owners([Owner("old", "parameter", 9000, 9100)])
    words = [8100, 8300, 8500, 9050, 9060]
    args = _args(
        words,
        freed=[(8000, 8200), (8200, 8400), (8400, 8600)],
        live_before=[(8200, 8400)],
    )
    args.kind = _kinds(OPAQUE, OPAQUE, POINTER, OPAQUE, POINTER)
    gp = classify(args, Owners([]), history, 4, None)
    # 8100: opaque, free as the capture began: dismissed. 8300: opaque, live then, freed
    # since, no record of the ops: undecided. 8500: a pointer: unowned. 9050/9060: a named
    # owner's memory now outside every allocation: 9060 a pointer (unowned), 9050 opaque.
    assert gp.dismissed == 1
    assert [(w.address, w.freed) for w in gp.undecided] == [(8300, True), (9050, True)]
    assert all("sanitize=True records them" in w.why for w in gp.undecided)
    assert sorted(w.address for w in gp.unowned) == [8500, 9060]
    assert [w.last_owner for w in gp.unowned if w.address == 9060] == ["old"]
    # Live as the capture began no longer proves a read (a stale host pointer into a
    # tensor of an earlier launch is just as live): 8300 stays undecided, never unowned.
    assert 8300 not in {w.address for w in gp.unowned}


def test_the_ops_record_decides_an_opaque_word() -> None:
    """Under the sanitizer the capture records every storage its ops were handed. An
    opaque word into one is a read (unowned once freed); an ATen kernel's opaque word
    into memory no op was handed is no pointer it uses (dismissed); a library kernel's is
    still undecided (its workspace is no op's tensor), and named so."""
    args = _args([8300, 8700], freed=[(8200, 8400), (8600, 8800)], live_before=[])
    args.live_before = None
    args.kind = _kinds(OPAQUE, OPAQUE)
    args.from_ops = [True, True]
    args.took = [(8200, 8400)]
    gp = classify(args, Owners([]), Owners([]), 4, None)
    assert [w.address for w in gp.unowned] == [8300] and gp.unowned[0].proven
    assert gp.undecided == () and gp.dismissed == 1
    args.from_ops = [False, False]  # a library's kernels
    gp = classify(args, Owners([]), Owners([]), 4, None)
    assert [w.address for w in gp.unowned] == [8300]
    assert [w.address for w in gp.undecided] == [8700]
    assert "library" in gp.undecided[0].why


def test_a_live_opaque_word_stays_unknown_and_a_live_pointer_is_proven() -> None:
    args = _args([7100, 7300], live=[(7000, 7200), (7200, 7400)])
    args.kind = _kinds(OPAQUE, POINTER)
    gp = classify(args, Owners([]), Owners([]), 4, None)
    assert [(w.address, w.proven, w.freed) for w in gp.unknown] == [
        (7100, False, False),
        (7300, True, False),
    ]


def test_audit_names_an_unnamed_allocation_freed_since_capture() -> None:
    """A graph took a live allocation no tensor names (a library's workspace, passed as a
    whole pointer argument: proven); freed after capture, the graph still takes its
    address: audit() lists it as stale with the graph."""
    prov = Provenance("r", True)
    prov.on = True
    live = Word(0x5000, "splitK_gemm", 4096, proven=True)
    gp = GraphProvenance(1, None, 3, 9, (), (live,), (), 0, 0.0)
    records = {1: SimpleNamespace(reads={(1, None): gp}, pending={}, unread=False)}
    assert prov.audit(records, Owners([]), freed=[(0x9000, 0xA000)]).stale == ()
    audit = prov.audit(records, Owners([]), freed=[(0x4000, 0x6000)])
    stale = audit.stale
    assert len(stale) == 1 and stale[0][2] == ((1, None),)
    assert "splitK_gemm" in stale[0][0] and "freed since capture" in stale[0][1]
    assert audit.undecided == ()


def test_audit_names_an_opaque_word_into_memory_freed_since_undecided() -> None:
    """Found on the H200 (the RL loop, an HF step graph read at its first question): a
    word inside an elementwise kernel's closure pointed into an allocation live when the
    graph was read and freed by the next question. Nothing proves it a read or not: it is
    listed undecided with why (not stale, not hidden), and the table says so."""
    prov = Provenance("r", True)
    prov.on = True
    why = "inside a closure or struct argument; the capture's ops were not recorded"
    word = Word(0x5000, "elementwise_kernel", 8716288, why=why)
    gp = GraphProvenance(1, None, 3, 9, (), (word,), (), 0, 0.0)
    records = {1: SimpleNamespace(reads={(1, None): gp}, pending={}, unread=False)}
    audit = prov.audit(records, Owners([]), freed=[(0x4000, 0x6000)])
    assert audit.stale == ()
    assert len(audit.undecided) == 1 and audit.undecided[0][2] == ((1, None),)
    assert "elementwise_kernel" in audit.undecided[0][0] and why in audit.undecided[0][1]
    assert "UNDECIDED" in audit.table()
    with pytest.warns(DeprecationWarning, match="Audit.undecided"):
        assert audit.unproven == ((audit.undecided[0][0], ((1, None),)),)


def test_classifying_67k_words_is_a_sorted_search_not_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    owners = Owners(
        [
            Owner(f"p{i}", "parameter", (i + 1) << 24, ((i + 1) << 24) + (1 << 20))
            for i in range(150)
        ]
    )
    hits = torch.randint(1, 151, (40000,), generator=g) << 24
    noise = torch.randint(0, 1 << 20, (27000,), generator=g)
    args = _graph_args.GraphArgs(
        words=torch.cat([hits, noise]),
        kernel=torch.randint(0, 263, (67000,), generator=g),
        kernels=[f"k{i}" for i in range(263)],
        pool=[(1 << 40, (1 << 40) + (1 << 30))],
    )
    took = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core runner torch's intra-op threads spin
    try:
        for _ in range(5):  # best of five
            t0 = time.perf_counter()
            gp = classify(args, owners, Owners([]), 8, None)
            took.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    assert len(gp.reads) == 150 and gp.words == 67000
    assert min(took) < 0.05, f"classifying 67k words took {min(took) * 1e3:.0f} ms"


def test_without_cuda_bindings_provenance_is_off_with_one_log_line(monkeypatch, caplog) -> None:
    monkeypatch.setattr(_graph_args, "_TRIED", False)
    monkeypatch.setattr(_graph_args, "_LOGGED", set())
    import builtins

    real = builtins.__import__

    def no_bindings(name, *a, **k):
        if name.startswith("cuda"):
            raise ImportError("no module named cuda.bindings")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bindings)
    monkeypatch.setattr(_graph_args.importlib.util, "find_spec", lambda name: None)

    class CudaLike:
        reads_graphs = "cuda"
        name = "cuda"

    with caplog.at_level(logging.WARNING, logger="graphguard"):
        off = Provenance("GraphRunner(x)", None)  # the default: off, nothing imported
        assert off.decide(CudaLike.reads_graphs, CudaLike.name) is False
        p = Provenance("GraphRunner(x)", True)
        assert p.decide("cuda", "cuda") is False and p.decide("cuda", "cuda") is False
        assert p.reads({}, 0) is None
    lines = [r for r in caplog.records if "cuda-bindings is not importable" in r.message]
    assert len(lines) == 1
    monkeypatch.setattr(_graph_args, "_TRIED", False)  # the next test imports again


def test_deciding_provenance_imports_nothing_the_first_capture_does(monkeypatch) -> None:
    """A lazy runner's stage decides provenance and captures nothing: the 36 ms import of
    ``cuda.bindings`` (H200 host) waits for the first capture that keeps a graph."""
    monkeypatch.setattr(_graph_args, "_TRIED", False)
    monkeypatch.setattr(_graph_args, "_DRIVER", None)
    monkeypatch.setattr(_graph_args.importlib.util, "find_spec", lambda name: object())
    imported: list[str] = []
    monkeypatch.setattr(_graph_args, "driver", lambda: imported.append("driver"))
    p = Provenance("GraphRunner(x)", None)
    assert p.decide("cuda", "cuda") == KEEP and p.on
    assert imported == []


def test_a_fresh_walk_adds_to_a_reused_owners_table_only_what_it_could_not_name() -> None:
    """A graph captured on a reused owners table is read against a fresh walk when the
    table cannot explain a word; the fresh walk adds owners, it never renames memory the
    table names (a weight moved since keeps its capture-time name, and a tensor now
    overlapping that memory is not taken for it)."""
    table = Owners([Owner("w", "parameter", 1000, 2000)])
    fresh = Owners(
        [
            Owner("w", "parameter", 5000, 6000),  # w moved since: the table's name stays
            Owner("new", "derived", 1500, 1600),  # inside w's old storage: not added
            Owner("wt", "derived", 3000, 3100),  # made since the walk: added
        ]
    )
    both = table.adding(fresh)
    names = {(o.name, o.start) for o in both.owners}
    assert names == {("w", 1000), ("wt", 3000)}
    hits = both.hit(torch.tensor([1000, 1550, 3050, 5500], dtype=torch.int64)).tolist()
    assert [both.owners[i].name if i >= 0 else None for i in hits] == ["w", "w", "wt", None]
