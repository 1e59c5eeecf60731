"""The refit context and its verdict on the CPU (issue 40): every tensor the graphs read
classified moved / derived / written / not written when ``with runner.refit():`` ends,
the same verdict from ``update_weights``; and what changed in provenance to make it the
default: graphs read on the first question (deferred), warnings once per graph, the
pool rule for a tensor the graph computes itself (weight_norm), the grouped audit table,
the fast argument read and the default decision.

Every runner here records reads under ``RecordingBackend`` with ``provenance=True``."""

from __future__ import annotations

import ctypes
import logging
import re
from array import array
from types import SimpleNamespace

import pytest
import torch

import graphguard as gg
from graphguard import _graph_args
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, StaleWeightsError, WeightsMovedError
from graphguard.provenance import KEEP, Owner, Owners, Provenance, classify
from graphguard.weights.refit import _checksum

SIZES = [1, 2, 4]


class Experts(torch.nn.Module):
    """Two linears around routed experts (one parameter), the shape of the field's
    "experts never synced" refits."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.experts = torch.nn.Parameter(torch.randn(2, 4, 4) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h @ self.experts[0] + h @ self.experts[1])


def runner(model: torch.nn.Module, **kw) -> gg.GraphRunner:
    kw.setdefault("provenance", True)
    r = gg.GraphRunner(
        model, (torch.zeros(2, 4),), sizes=SIZES, backend=RecordingBackend(), progress=False, **kw
    )
    r.capture()
    return r


def fresh(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def write(model: torch.nn.Module, sd: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    """A loader writing in place (``copy_`` under no_grad), except the names in ``skip``."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name not in skip:
                t.copy_(sd[name])


def equals_eager(r: gg.GraphRunner, model: torch.nn.Module) -> None:
    for n in (1, 3, 4):
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(r(x), model(x))


# ------------------------------------------------------------------ the refit context


def test_refit_names_a_weight_the_loader_did_not_write_with_the_graphs_that_read_it() -> None:
    m = Experts()
    r = runner(m)
    sd = fresh(m)
    with pytest.raises(StaleWeightsError) as err, r.refit():
        write(m, sd, skip=("experts",))
    assert err.value.names == ("experts",)
    text = str(err.value)
    assert "experts (parameter): not written by the refit" in text
    assert "read by size 1,2,4 (3 graphs)" in text and "strict=False" in text


def test_refit_strict_false_only_reports() -> None:
    m = Experts()
    r = runner(m)
    with r.refit(strict=False) as refit:
        write(m, fresh(m), skip=("experts",))
    v = refit.verdict
    assert v is not None and not v.ok and v.reads_known and v.how == "observed"
    assert [u.name for u in v.missing] == ["experts"]
    assert v.missing[0].graphs == ((1, None), (2, None), (4, None))
    assert set(v.written) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert v.moved == () and v.derived == ()


def test_refit_expect_names_what_the_refit_must_write() -> None:
    m = Experts()
    r = runner(m)
    sd = fresh(m)
    with r.refit(expect=["a.weight"]) as refit:  # the rest may stay as they are
        with torch.no_grad():
            m.a.weight.copy_(sd["a.weight"])
    assert refit.verdict is not None and refit.verdict.ok
    rest = {u.name for u in refit.verdict.not_written}
    assert rest == {"a.bias", "b.weight", "b.bias", "experts"}
    with pytest.raises(ConfigError, match=r"a\.wieght \(did you mean 'a\.weight'\?\)"):
        with r.refit(expect=["a.wieght"]):
            pass
    with pytest.raises(ConfigError, match="takes names"):
        r.refit(expect="a.weight")  # type: ignore[arg-type]


def test_a_loader_writing_every_tensor_in_place_reports_nothing() -> None:
    m = Experts()
    r = runner(m)
    with r.refit() as refit:
        m.load_state_dict(fresh(m))
    v = refit.verdict
    assert v is not None and v.ok and v.not_written == () and v.moved == ()
    assert len(v.written) == 5 and "0 expected not written" in v.summary()
    equals_eager(r, m)


class Packed(torch.nn.Module):
    """q, k and v as three parameters viewing one packed buffer (vLLM's fused QKV):
    they share one storage and one version counter."""

    def __init__(self) -> None:
        super().__init__()
        buf = torch.randn(12, 4) * 0.3
        self.q = torch.nn.Parameter(buf[0:4])
        self.k = torch.nn.Parameter(buf[4:8])
        self.v = torch.nn.Parameter(buf[8:12])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.q) + (x @ self.k) * (x @ self.v)


def test_a_loader_writing_through_views_of_a_packed_buffer() -> None:
    m = Packed()
    assert m.q.untyped_storage().data_ptr() == m.v.untyped_storage().data_ptr()
    r = runner(m)
    sd = fresh(m)
    with r.refit() as refit:  # every view written: nothing reported
        with torch.no_grad():
            for name in ("q", "k", "v"):
                getattr(m, name).copy_(sd[name])
    assert refit.verdict is not None and refit.verdict.ok
    equals_eager(r, m)
    # q and k written, v not: the shared version counter moved for all three, so each
    # view's own checksum decides, and v is named.
    with pytest.raises(StaleWeightsError) as err, r.refit():
        with torch.no_grad():
            m.q.copy_(sd["q"] * 2)
            m.k.copy_(sd["k"] * 2)
    assert err.value.names == ("v",)


def test_a_loader_writing_through_dot_data_is_seen_by_its_checksum() -> None:
    """``param.data.copy_(w)`` (vLLM's default_weight_loader) bumps no version counter."""
    m = Experts()
    r = runner(m)
    sd = fresh(m)
    before = m.experts._version
    with r.refit() as refit:
        for name, p in m.named_parameters():
            p.data.copy_(sd[name])
    assert m.experts._version == before
    assert refit.verdict is not None and refit.verdict.ok
    assert "experts" in refit.verdict.written
    equals_eager(r, m)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 4).to(torch.bfloat16),  # 48 B: int64 words
        lambda: torch.randn(3, 3).to(torch.bfloat16),  # 18 B: elements as int16
        lambda: torch.randn(4, 6)[:, :4],  # not contiguous: elements as int32
        lambda: torch.randn(4, 4, dtype=torch.float64).t(),  # transposed
    ],
)
def test_the_refit_checksum_changes_with_any_one_element(make) -> None:
    """Whichever form a tensor's checksum takes (int64 words when its bytes are whole
    aligned words, else its elements' bit patterns), one element changed changes it."""
    t = make()
    base = _checksum(t)
    assert base is not None
    for i in range(t.numel()):
        u = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        u.copy_(t)  # the same layout, so the same form of checksum
        assert int(_checksum(u)) == int(base)
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), t.shape))
        u[idx] += 1
        assert int(_checksum(u)) != int(base), (i, t.dtype, tuple(t.shape))


def test_a_buffer_outside_expect_is_judged_by_its_version_counter_alone() -> None:
    """Checksums cost a read of what they cover, so only what a verdict can turn on is
    summed (expected weights, derived tensors): a buffer the refit is not meant to change
    is written or not by its version counter (reported, never raised)."""
    m = Experts()
    m.register_buffer("scale", torch.ones(4))
    m.forward = lambda x: Experts.forward(m, x) * m.scale  # type: ignore[method-assign]
    r = runner(m)
    sd = fresh(m)
    with r.refit() as refit:
        write(m, sd, skip=("scale",))
    assert refit.verdict is not None and refit.verdict.ok
    assert [u.name for u in refit.verdict.not_written] == ["scale"]
    with r.refit() as refit:
        write(m, sd)
    assert refit.verdict is not None and "scale" in refit.verdict.written


def test_a_loader_that_moves_a_weight_raises_or_recaptures() -> None:
    m = Experts()
    r = runner(m)
    sd = fresh(m)

    def loader() -> None:
        write(m, sd, skip=("a.weight",))
        m.a.weight = torch.nn.Parameter(sd["a.weight"].clone())  # at a new address

    with pytest.raises(WeightsMovedError, match=r"a\.weight"), r.refit():
        loader()
    with r.refit(on_moved="recapture") as refit:
        loader()
    v = refit.verdict
    assert v is not None and [x.name for x in v.moved] == ["a.weight"]
    assert refit.update.recaptured == {r.label: tuple(SIZES)}
    assert r.check_weights().ok
    equals_eager(r, m)
    # a tensor moved before the refit began is not blamed on the loader
    m.b.weight = torch.nn.Parameter(m.b.weight.detach().clone())
    with pytest.raises(WeightsMovedError, match="as the refit began"), r.refit():
        pass


class Derived(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.rederive()

    def rederive(self) -> None:
        self.wt = self.lin.weight.detach().t().contiguous()

    def rederive_in_place(self) -> None:
        with torch.no_grad():
            self.wt.copy_(self.lin.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wt + self.lin.bias


def test_a_derived_tensor_is_refreshed_or_named_stale() -> None:
    m = Derived()
    r = runner(m)
    with pytest.raises(StaleWeightsError, match=r"wt \(derived\): derived at load") as err:
        with r.refit():
            m.load_state_dict(fresh(m, 2))
    assert err.value.names == ("wt",)
    with r.refit() as refit:  # the loader re-derives in place: written
        m.load_state_dict(fresh(m, 3))
        m.rederive_in_place()
    assert refit.verdict is not None and refit.verdict.ok and "wt" in refit.verdict.written
    with r.refit(refresh=m.rederive_in_place) as refit:  # refresh= does it on exit
        m.load_state_dict(fresh(m, 4))
    assert refit.verdict is not None and refit.verdict.ok
    equals_eager(r, m)


def test_a_block_that_raises_is_not_judged_and_releases_the_runner() -> None:
    m = Experts()
    r = runner(m)
    refit = r.refit()
    with pytest.raises(ValueError, match="loader broke"), refit:
        raise ValueError("loader broke")
    assert refit.verdict is None
    assert r.check_weights().ok  # the guard was released


def test_without_provenance_every_parameter_counts_as_read_by_every_graph() -> None:
    m = Experts()
    r = runner(m, provenance=None)  # the CPU emulation reads only when asked
    with r.refit(strict=False) as refit:
        write(m, fresh(m), skip=("b.bias",))
    v = refit.verdict
    assert v is not None and not v.reads_known
    assert [(u.name, u.graphs) for u in v.missing] == [("b.bias", tuple((s, None) for s in SIZES))]


# ------------------------------------------------------------------ update_weights


def test_update_weights_returns_the_same_verdict() -> None:
    m = Experts()
    r = runner(m)
    up = r.update_weights(fresh(m))
    assert up.refit is not None and up.refit.ok and up.refit.how == "copy"
    assert set(up.refit.written) == {n for n, _ in m.named_parameters()}
    sd = fresh(m, 5)
    del sd["experts"]
    up = r.update_weights(sd, strict=False)  # a subset: reported, not raised
    assert up.refit is not None and [u.name for u in up.refit.missing] == ["experts"]
    assert "NOT OK" in up.summary()
    equals_eager(r, m)


def test_update_weights_from_a_loader_is_observed() -> None:
    m = Experts()
    r = runner(m)
    sd = fresh(m)
    with pytest.raises(StaleWeightsError, match="experts"):
        r.update_weights(lambda: write(m, sd, skip=("experts",)))
    up = r.update_weights(lambda: write(m, sd))
    assert up.loaded_by_callable and up.refit is not None and up.refit.ok
    assert up.refit.how == "observed"


def test_update_weights_reuses_its_validated_plan_while_nothing_changed() -> None:
    m = Experts()
    r = runner(m)
    room = r.door.weights
    trainer = fresh(m, 1)  # a trainer's tensors, stepped in place between updates
    r.update_weights(trainer)
    first = room.cache["plan"]
    with torch.no_grad():
        for t in trainer.values():
            t.mul_(1.5)
    r.update_weights(dict(trainer))  # a new dict, the same tensors: the plan is reused
    assert room.cache["plan"] is first
    equals_eager(r, m)
    bad = {k: v.double() if k == "a.bias" else v for k, v in fresh(m, 3).items()}
    with pytest.raises(ConfigError, match=r"a\.bias: expected float32 \[4\], got float64 \[4\]"):
        r.update_weights(bad)
    m.b.weight = torch.nn.Parameter(m.b.weight.detach().clone())  # the module changed
    r.recapture(reason="test", only_moved=True)
    r.update_weights(fresh(m, 4))
    assert room.cache["plan"] is not first


# ------------------------------------------------------------------ provenance itself


def test_graphs_are_read_on_the_first_question_not_at_capture() -> None:
    r = runner(Experts())
    records = r._store.records
    assert all(rec.pending and not rec.reads for rec in records.values())
    audit = r.audit()
    assert len(audit.graphs) == 3
    assert all(rec.reads and not rec.pending for rec in records.values())
    prov = r._reads.provenance
    assert prov.resolve(records) is False  # nothing left to read


class DerivesLater(torch.nn.Module):
    """A linear whose transposed weight is made at the first call of batch 4 or more (a
    derived tensor that appears between two lazy captures)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.wt: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 4:
            return self.lin(x)
        if self.wt is None:
            self.wt = self.lin.weight.detach().t().contiguous()
        return x @ self.wt + self.lin.bias


def test_a_lazy_capture_reuses_the_owners_walk_and_still_names_a_tensor_made_since(
    monkeypatch,
) -> None:
    """Each lazy size is a capture run of its own; while every tensor is where the last
    walk found it, the run reuses that walk (a lazy capture walks nothing). A derived
    tensor made after the walk is not in the reused table: the graph's read finds it in
    a fresh walk, so the derived read is named and a refit that leaves it stale is
    refused."""
    from graphguard import owners as owners_mod

    walks = []
    real = owners_mod.Owners.of.__func__  # type: ignore[attr-defined]

    def counting(cls, **kw):
        walks.append(1)
        return real(cls, **kw)

    m = DerivesLater()
    r = runner(m, lazy=gg.Lazy())  # lazy: capture() runs the stage, sizes come on use
    monkeypatch.setattr(owners_mod.Owners, "of", classmethod(counting))
    with torch.no_grad():
        for n in (1, 1, 2, 2):  # first call at a size: its warmup; the next captures
            r(torch.randn(n, 4))
        assert sorted(r.captured_sizes) == [1, 2]
        assert len(walks) == 1, "the second lazy capture walked the module again"
        for _ in range(2):
            r(torch.randn(4, 4))  # makes wt, then captures size 4 on the reused table
    assert sorted(r.captured_sizes) == [1, 2, 4]
    assert len(walks) == 1
    audit = r.audit()
    assert "wt" in audit.derived, audit.table()
    assert audit.reading("wt") == ((4, None),)
    assert len(walks) == 2  # the read of size 4's graph walked once more
    with pytest.raises(ConfigError, match="wt"):
        r.update_weights(fresh(m))  # the graphs read wt, which a copy would leave stale


def test_a_weight_moved_before_the_first_question_is_named_on_a_reused_table() -> None:
    """A graph captured on a reused owners table, read after a derived tensor was made
    (so a fresh walk is taken at its first question) and after a weight moved: the fresh
    walk only adds what the table could not name, so the graph still reads the weight
    where its capture saw it, and check_weights() names the move."""
    m = DerivesLater()
    r = runner(m, lazy=gg.Lazy())  # lazy: capture() runs the stage, sizes come on use
    with torch.no_grad():
        for n in (1, 1, 4, 4):  # size 1 walks; size 4 (wt made at its first call) reuses
            r(torch.randn(n, 4))
    assert sorted(r.captured_sizes) == [1, 4]
    m.lin.bias = torch.nn.Parameter(torch.randn(4))  # moved before anything was asked
    found = r.check_weights()
    assert [mv.name for mv in found.moved] == ["lin.bias"], found.message()
    assert 4 in found.moved[0].sizes


class FreesWhileCaptured(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(4, 4)
        y = self.lin(x) @ self.cache
        if gg.phase.is_capturing():
            self.cache = None
        return y


def test_a_graph_taking_freed_memory_is_warned_about_once_per_graph_also_when_rebuilt(
    caplog,
) -> None:
    def build() -> gg.GraphRunner:
        return gg.GraphRunner(
            FreesWhileCaptured(), (torch.zeros(2, 4),), sizes=[2], backend=RecordingBackend(),
            provenance=True, progress=False, name="frees",
        )  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="graphguard"), torch.no_grad():
        for _ in range(2):  # a rebuilt runner (same label) warns for its own new graph
            r = build()
            r.capture()
            r.audit()
            r.check_weights()
            r.audit()
    lines = [x.message for x in caplog.records if "memory no live tensor owns" in x.message]
    assert len(lines) == 2, lines
    assert "it is kept and serves" in lines[0] and "size 2 graph" in lines[0]
    assert "first read after its capture" in lines[0]


def test_a_derived_tensor_in_the_graphs_own_pool_is_a_temporary() -> None:
    """A legacy weight_norm pre-hook sets ``module.weight`` inside the captured step: the
    graph computes it on every replay (in its pool), so it is no derived read."""
    owners = Owners(
        [Owner("lin.weight_g", "parameter", 1000, 1100)],
        [Owner("lin.weight", "derived", 5000, 5100), Owner("mask", "derived", 7000, 7100)],
    )
    args = _graph_args.GraphArgs(
        words=torch.tensor([1000, 5000, 7000]),
        kernel=torch.arange(3),
        kernels=["k0", "k1", "k2"],
        pool=[(4000, 6000)],
    )
    gp = classify(args, owners, Owners([]), 4, None)
    assert [r.name for r in gp.reads] == ["lin.weight_g", "mask"]
    assert gp.temporaries == 1


@pytest.mark.parametrize("kind", ["legacy", "parametrizations"])
def test_weight_norm_is_no_false_positive(kind: str) -> None:
    lin = torch.nn.Linear(4, 4)
    if kind == "legacy":
        with pytest.warns(FutureWarning):
            m = torch.nn.utils.weight_norm(lin)
    else:
        m = torch.nn.utils.parametrizations.weight_norm(lin)
    r = runner(m)
    with torch.no_grad():
        m(torch.randn(3, 4))  # an eager call re-creates the legacy module.weight
    assert r.check_weights().ok and r.audit().derived == () and r.audit().stale == ()
    up = r.update_weights(fresh(m))  # not refused: the graphs derive weight themselves
    assert up.refit is not None and up.refit.ok
    with torch.no_grad():
        equals_eager(r, m)


def test_audit_table_names_what_each_graph_reads_grouped() -> None:
    class Deep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    r = runner(Deep())
    text = str(r.audit())
    print(text)
    assert "sizes 1,2,4 (3 graphs)" in text
    assert "parameter (12): layers.{0..5}.{bias,weight} (12)" in text
    assert "static input (1): input[0]" in text
    assert {x.name for g in r.audit().graphs for x in g.reads} >= {"layers.5.bias"}


# ------------------------------------------------------------------ reading the driver


def test_a_packed_argument_block_is_read_once_and_its_gaps_zeroed(monkeypatch) -> None:
    """The fast path (one read of the node's argument block) gives what reading each
    argument on its own gives, with the padding between arguments zero."""
    block = (ctypes.c_uint8 * 32)(*([0xAB] * 32))  # garbage everywhere
    ctypes.memmove(ctypes.addressof(block), (1234).to_bytes(4, "little"), 4)  # int at 0
    ctypes.memmove(ctypes.addressof(block) + 8, (0x7F00_0000_1000).to_bytes(8, "little"), 8)
    ctypes.memmove(ctypes.addressof(block) + 16, (0x7F00_0000_2000).to_bytes(8, "little"), 8)
    params = [(0, 4), (8, 8), (16, 8)]
    base = ctypes.addressof(block)

    def node(ptrs: list[int]) -> SimpleNamespace:
        arr = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        keep.append(arr)
        return SimpleNamespace(func=7, kern=0, kernelParams=ctypes.addressof(arr), extra=0)

    keep: list = []
    monkeypatch.setitem(_graph_args._LAYOUTS, 7, _graph_args._Layout("k", params))
    packed = node([base + o for o, _ in params])
    # the same values, each argument in its own buffer (not one block)
    separate = [(ctypes.c_uint8 * n).from_buffer_copy(bytes(block)[o : o + n]) for o, n in params]
    keep.extend(separate)
    apart = node([ctypes.addressof(b) for b in separate])
    d = SimpleNamespace()
    got_packed = _graph_args._kernel_bytes(d, packed)
    got_apart = _graph_args._kernel_bytes(d, apart)
    assert got_packed == got_apart
    _, blob, exact = got_packed
    words = array("Q", blob).tolist()
    assert words == [1234, 0x7F00_0000_1000, 0x7F00_0000_2000]  # the gap after the int: 0
    assert exact == b"\x00\x01\x01"


def test_provenance_is_on_by_default_for_cuda_graphs_and_off_when_asked(monkeypatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_PROVENANCE", raising=False)
    monkeypatch.setattr(_graph_args, "driver", lambda: object())
    default = Provenance("r", None)
    assert default.decide("cuda", "cuda") == KEEP and "on by default" in default._why
    assert Provenance("r", None, strict=True).decide("cuda", "cuda") is True  # sanitizer
    assert Provenance("r", False).decide("cuda", "cuda") is False
    assert Provenance("r", None).decide("cpu", "recording") is False  # CPU stays opt-in
    assert Provenance("r", True).decide("cpu", "recording") is True
    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "0")
    assert Provenance("r", None).decide("cuda", "cuda") is False
    monkeypatch.setattr(_graph_args, "driver", lambda: None)
    monkeypatch.delenv("GRAPHGUARD_PROVENANCE")
    off = Provenance("r", None)
    assert off.decide("cuda", "cuda") is False and "graphguard[cuda]" in off._why


def test_message_names_each_not_written_weight_once() -> None:
    m = Experts()
    r = runner(m)
    with r.refit(strict=False) as refit:
        pass
    v = refit.verdict
    assert v is not None
    msg = v.message()
    assert len(re.findall(r"- experts \(parameter\)", msg)) == 1
    assert len(v.missing) == 5


# ------------------------------------------------------------------ every runner kind


def test_graphed_causal_lm_refit_names_a_weight_the_loader_skipped() -> None:
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama")
    g = GraphedCausalLM(
        model, max_batch=2, max_cache_len=16, backend=RecordingBackend(), progress=False,
        provenance=True,
    )  # fmt: skip
    g.capture()
    new = F.model("llama", seed=5).state_dict()
    skipped = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(StaleWeightsError) as err, g.refit():
        model.load_state_dict({k: v for k, v in new.items() if k != skipped}, strict=False)
    assert err.value.names == (skipped,)
    with g.refit() as ok:
        model.load_state_dict(new)
    assert ok.verdict is not None and ok.verdict.ok and ok.verdict.reads_known
    g.release()


def test_continuous_batching_refit_and_weight_sync_carry_the_verdict() -> None:
    pytest.importorskip("transformers")
    from tests import hf_families as F
    from tests.test_hf_continuous import graphed, run

    model = F.model("qwen2", seed=0)
    policy = F.model("qwen2", seed=50)
    cb = graphed(model, provenance=True)
    try:
        run(cb)  # the step graphs exist
        with cb.refit() as r:
            model.load_state_dict(policy.state_dict())
        assert r.verdict is not None and r.verdict.ok and r.verdict.graphs > 0
        skipped = "model.norm.weight"
        with pytest.raises(StaleWeightsError, match=re.escape(skipped)), cb.refit():
            with torch.no_grad():
                for name, t in model.named_parameters():
                    if name != skipped:
                        t.mul_(1.5)
        sync = cb.weight_sync(policy)
        update = sync()
        assert update.refit is not None and update.refit.ok and update.refit.how == "copy"
        params = {n for n, _ in model.named_parameters()}
        assert params <= set(update.refit.written) and update.refit.missing == ()
    finally:
        cb.close()


@pytest.mark.compile
def test_dispatcher_refit_judges_both_runners_over_one_model() -> None:
    from tests.test_piecewise import Tiny, batch

    torch._dynamo.reset()
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
    try:
        d.capture()
        with d.refit(strict=False) as r:
            with torch.no_grad():
                model.o[1].mul_(2.0)
        v = r.verdict
        assert v is not None and "o.1" in v.written and "q.0" in {u.name for u in v.missing}
        assert " / " in v.owner  # both runners judged
    finally:
        d.release()
        torch._dynamo.reset()


@pytest.mark.compile
def test_piecewise_runner_refit_names_the_weight_its_pieces_read_and_the_loader_skipped() -> None:
    """The piecewise runner's refit: the same verdict over its pieces' graphs; a weight the
    loader skipped raises, one it wrote is served by the next replay."""
    from tests.test_piecewise import batch, make

    torch._dynamo.reset()
    r, model = make(provenance=True)
    try:
        r.capture()
        with pytest.raises(StaleWeightsError) as err, r.refit():
            with torch.no_grad():
                model.o[1].mul_(2.0)
        assert "q.0" in err.value.names and "o.1" not in err.value.names
        with r.refit(strict=False) as refit:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        v = refit.verdict
        assert v is not None and v.ok and "o.1" in v.written and "q.0" in v.written
        x = batch(3, seed=5)
        torch.testing.assert_close(r(*x), model(*x))
    finally:
        r.release()
        torch._dynamo.reset()


def test_the_sanitizer_drops_a_cudnn_dropout_state_only_on_provenances_proof() -> None:
    """An unnamed storage first handed to ``_cudnn_rnn`` (cuDNN's dropout state) that no
    word of the graph points into is not watched; one the graph takes is; without the
    graph's reads (provenance off) every one is; other ops' storages are never dropped
    (a kernel may read through a pointer table no argument shows)."""
    from graphguard.sanitizer.checks import _untaken_rnn_states
    from graphguard.sanitizer.storages import TrackedStorage

    def tracked(ptr: int, op: str, name: str | None = None) -> TrackedStorage:
        return TrackedStorage(None, ptr, 6 << 20, name, "uint8 [6291456]", op, "site")  # type: ignore[arg-type]

    state = tracked(0x10000000, "aten._cudnn_rnn")
    other = tracked(0x20000000, "aten.mm")
    weight = tracked(0x30000000, "aten._cudnn_rnn", name="lstm.weight_ih_l0")
    items = [state, other, weight]
    assert _untaken_rnn_states(items, [(0x30000000, 0x30001000)]) == [other, weight]
    assert _untaken_rnn_states(items, [(0x10000040, 0x10000041)]) == items  # taken
    assert _untaken_rnn_states(items, None) == items
