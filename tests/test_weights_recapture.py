"""A recapture rebuilds the weight record it proves (issue 49): every way of moving a
weight is refused or reported by name, and after the recapture its error documents
(``recapture(reason=..., only_moved=True)``, or a full ``recapture``) the record
describes the module as it is now: ``check_weights()`` is true, the runner serves, its
output equals eager, and a later move of the new tensors is caught.

The moves: ``.data =``, ``load_state_dict(assign=True)``, ``.to()`` there and back, a
replaced submodule, a removed parametrization (``weight_norm``) and a re-tied embedding.
A replaced submodule and a removed parametrization were the regression: the record was
reused from the last capture (its proof that nothing changed saw only the dicts that
held tensors then), so a recapture kept proving the old tensors.

The RecordingBackend's FULL replay re-runs the step, so there "equals eager" holds for
any record; the record is asserted directly (every live name checked). A piece of a
PIECEWISE runner replays the tensors it was captured with, so there the stale output is
shown before the recapture.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.errors import GraphGuardError, WeightsMovedError
from graphguard.weights import WeightCheck
from graphguard.weights.record import named_tensors

D = 6
VOCAB = 7
SIZES = [1, 2, 4]


@torch.library.custom_op("gg_recapture_test::mix", mutates_args=())
def mix(x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ mem.t(), dim=-1) @ mem


@mix.register_fake
def _(x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Tiny(torch.nn.Module):
    """A block with an MLP, a projection without bias, an op PIECEWISE splits at, and an
    output head tied to an embedding. ``parametrized``: the projection under
    ``weight_norm`` (its weight computed from two originals at every forward)."""

    def __init__(self, *, parametrized: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D)
        )
        self.proj = torch.nn.Linear(D, D, bias=False)
        if parametrized:
            weight_norm(self.proj)
        self.mem = torch.nn.Parameter(torch.randn(5, D))
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.gg_recapture_test.mix(self.mlp(x), self.mem) + x
        return self.head(self.proj(h))


def _data(m: Tiny) -> tuple[str, ...]:
    m.mlp[0].weight.data = m.mlp[0].weight.data * 2
    return ("mlp.0.weight",)


def _assign(m: Tiny) -> tuple[str, ...]:
    g = torch.Generator().manual_seed(7)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    return ("mlp.0.weight", "mem", "proj.weight")


def _to(m: Tiny) -> tuple[str, ...]:
    # New storages, then back: the dtype as captured, not the address (the old storages
    # held meanwhile, or the allocator may hand a weight its old block back: not moved).
    held = [p.data for p in m.mlp.parameters()]
    m.mlp.to(torch.float64)
    m.mlp.to(torch.float32)
    del held
    return ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")


def _submodule(m: Tiny) -> tuple[str, ...]:
    m.mlp[2] = torch.nn.Linear(D, D).eval()  # same device and dtype, new values
    return ("mlp.2.weight", "mlp.2.bias")


def _parametrization(m: Tiny) -> tuple[str, ...]:
    parametrize.remove_parametrizations(m.proj, "weight")  # proj.weight registered again
    return ("proj.parametrizations.weight.original0", "proj.parametrizations.weight.original1")


def _retie(m: Tiny) -> tuple[str, ...]:
    w = torch.nn.Parameter(m.embed.weight.detach() * 1.5)
    m.embed.weight = w
    m.head.weight = w
    return ("embed.weight", "head.weight")


MOVES: dict[str, Callable[[Tiny], tuple[str, ...]]] = {
    "param.data = new": _data,
    "load_state_dict(assign=True)": _assign,
    ".to(float64).to(float32)": _to,
    "submodule replaced": _submodule,
    "parametrization removed": _parametrization,
    "embedding re-tied": _retie,
}


def tiny(move: str) -> Tiny:
    return Tiny(parametrized=move == "parametrization removed").eval()


def live_names(m: torch.nn.Module) -> list[str]:
    return [name for name, *_ in named_tensors(m)]


def clones(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def moved(found: WeightCheck) -> set[str]:
    return {m.name for m in found.moved}


def refused(found: WeightCheck, names: tuple[str, ...]) -> None:
    """The move is reported by name, with the documented fix."""
    assert not found.ok and set(names) <= moved(found), found.message()
    with pytest.raises(WeightsMovedError, match=re.escape(names[0])) as info:
        found.raise_if_moved()
    assert "recapture(reason=..., only_moved=True)" in str(info.value)


def current(found: WeightCheck, model: torch.nn.Module) -> None:
    """Nothing moved, and the record is the module as it is now: every live name."""
    assert found.ok, found.message()
    assert found.checked == len(live_names(model))


def moved_again(check: Callable[[], WeightCheck], model: torch.nn.Module) -> None:
    """The new tensors are the ones the record proves: moving one is caught by name."""
    name = "mlp.2.weight"
    t = model.get_parameter(name)
    t.data = t.data.clone()
    assert name in moved(check())


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------ GraphRunner


@pytest.mark.parametrize("form", ["only_moved", "only_moved, provenance", "full"])
@pytest.mark.parametrize("move", list(MOVES))
@torch.no_grad()
def test_graph_runner_recapture_rebuilds_the_record_for_every_move(move: str, form: str) -> None:
    model = tiny(move)
    r = gg.GraphRunner(
        model,
        (torch.zeros(1, D),),
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
        provenance=form.endswith("provenance"),
    )
    r.capture()
    assert r.check_weights().ok
    names = MOVES[move](model)
    refused(r.check_weights(), names)
    with pytest.raises(WeightsMovedError, match="no weight changed"):
        r.update_weights(clones(model))
    if form == "full":
        r.recapture(reason=move)
    else:
        report = r.recapture(reason=move, only_moved=True)
        assert sorted(report.captured) == SIZES  # every size reads each moved tensor
    current(r.check_weights(), model)
    for n in (1, 3, 4):
        x = torch.randn(n, D)
        torch.testing.assert_close(r(x), model(x))
    r.update_weights(clones(model))  # in place again: the new tensors are the captured ones
    moved_again(r.check_weights, model)


@torch.no_grad()
def test_a_removed_name_no_graph_reads_is_gone_not_moved() -> None:
    """Reads known: a name that no longer exists and that no graph reads is not reported
    (nothing to recapture); with the same move a graph does read, it is, until the
    recapture. Only the size-4 graph reads ``extra`` here."""

    class Branch(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Linear(D, D, bias=False)
            weight_norm(self.extra)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out + self.extra(x).sum() if x.shape[0] > 2 else out

    model = Branch().eval()
    backend = RecordingBackend()
    r = gg.GraphRunner(
        model, (torch.zeros(1, D),), sizes=SIZES, backend=backend, progress=False, provenance=True
    )
    r.capture()
    parametrize.remove_parametrizations(model.extra, "weight")
    found = r.check_weights()
    originals = {f"extra.parametrizations.weight.original{i}" for i in (0, 1)}
    assert moved(found) == originals and found.sizes == (4,)
    backend.events.clear()
    report = r.recapture(reason="weight_norm removed", only_moved=True)
    assert report.captured == [4]  # sizes 1 and 2 keep their graphs, and their records
    current(r.check_weights(), model)
    x = torch.randn(4, D)
    torch.testing.assert_close(r(x), model(x))
    # Recorded at a recapture, read by no graph, then deleted: gone, not moved.
    model.register_buffer("unread", torch.zeros(3))
    assert r.recapture(reason="a buffer no graph reads", only_moved=True).captured == []
    assert "unread" in live_names(model) and r.check_weights().checked == len(live_names(model))
    del model.unread
    found = r.check_weights()
    assert found.ok and found.reads_known, found.message()


# ------------------------------------------------------------------ PiecewiseRunner


@pytest.mark.parametrize("move", ["submodule replaced", "parametrization removed"])
@torch.no_grad()
def test_piecewise_recapture_rebuilds_the_record(move: str, fresh_dynamo: Any) -> None:
    model = tiny(move)
    r = gg.PiecewiseRunner(
        model,
        (torch.zeros(1, D),),
        split_ops=[torch.ops.gg_recapture_test.mix],
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
    )
    r.capture()
    x = torch.randn(3, D)
    names = MOVES[move](model)
    if move == "submodule replaced":  # a piece would replay the old module's tensors
        with pytest.raises(GraphGuardError, match="moved since capture"):
            r(x)
    refused(r.check_weights(), names)
    r.recapture(reason=move, only_moved=True)
    current(r.check_weights(), model)
    torch.testing.assert_close(r(x), model(x))
    moved_again(r.check_weights, model)


# ------------------------------------------------------------------ the dispatcher


@torch.no_grad()
def test_dispatcher_recapture_rebuilds_both_runners_records(fresh_dynamo: Any) -> None:
    from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan

    model = tiny("submodule replaced")
    full = gg.GraphRunner(
        model, (torch.zeros(1, D),), sizes=[1, 2], backend=RecordingBackend(), progress=False
    )
    pw = gg.PiecewiseRunner(
        model,
        (torch.zeros(1, D),),
        split_ops=[torch.ops.gg_recapture_test.mix],
        sizes=SIZES,
        backend=RecordingBackend(),
        progress=False,
    )
    plan = DispatchPlan(
        "full_and_piecewise", max_tokens=4, full_sizes=[1, 2], piecewise_sizes=SIZES
    )
    d = Dispatcher(plan, eager=model, full=full, piecewise=pw)
    d.capture()
    names = _submodule(model)
    checks = d.check_weights()
    assert set(checks) == {"full", "piecewise"}
    for found in checks.values():
        refused(found, names)
    d.recapture(reason="mlp.2 replaced", only_moved=True)
    for found in d.check_weights().values():
        current(found, model)
    torch.testing.assert_close(d(BatchKey.decode(2), x := torch.randn(2, D)), model(x))
    torch.testing.assert_close(d(BatchKey(3), x := torch.randn(3, D)), model(x))
    d.recapture(reason="a full one too")
    for found in d.check_weights().values():
        current(found, model)
    torch.testing.assert_close(d(BatchKey(3), x), model(x))


# ------------------------------------------------------------------ GraphedCausalLM

HF_NEW = 5


def _hf() -> Any:
    pytest.importorskip("transformers")
    from tests import hf_families

    return hf_families


def _hf_move(model: Any, move: str) -> tuple[str, ...]:
    """The issue's moves on a tiny Llama (2 layers, ``tie_word_embeddings`` on)."""
    layer = model.model.layers[1]
    if move == "submodule replaced":
        old = layer.mlp.down_proj
        new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        layer.mlp.down_proj = new.to(old.weight.dtype).eval()
        return ("model.layers.1.mlp.down_proj.weight",)
    if move == "parametrization removed":
        parametrize.remove_parametrizations(layer.self_attn.o_proj, "weight")
        return tuple(
            f"model.layers.1.self_attn.o_proj.parametrizations.weight.original{i}" for i in (0, 1)
        )
    if move == "embedding re-tied":
        w = torch.nn.Parameter(model.model.embed_tokens.weight.detach() * 1.5)
        model.model.embed_tokens.weight = w
        model.lm_head.weight = w
        return ("model.embed_tokens.weight", "lm_head.weight")
    if move == "param.data = new":
        p = layer.mlp.up_proj.weight
        p.data = p.data * 1.5
        return ("model.layers.1.mlp.up_proj.weight",)
    if move == "load_state_dict(assign=True)":
        g = torch.Generator().manual_seed(11)
        sd = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.state_dict().items()}
        sd = {k: (v + 1 if "norm" in k else v) for k, v in sd.items()}
        model.load_state_dict(sd, assign=True)
        return ("model.layers.0.self_attn.q_proj.weight",)
    assert move == ".to(float64).to(float32)"
    held = [p.data for p in layer.parameters()]  # as in _to: a new address for each
    layer.to(torch.float64)
    layer.to(torch.float32)
    del held
    return ("model.layers.1.mlp.gate_proj.weight",)


@pytest.mark.parametrize("move", list(MOVES))
@torch.no_grad()
def test_graphed_causal_lm_generates_after_the_documented_recapture(move: str) -> None:
    F = _hf()
    from graphguard.integrations.transformers import GraphedCausalLM

    model = F.model("llama", seed=0, tie_word_embeddings=True)
    if move == "parametrization removed":
        weight_norm(model.model.layers[1].self_attn.o_proj)
        model.eval()
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=32, backend=RecordingBackend(), progress=False
    )
    g.capture()
    ids, mask = F.prompts(4, seed=3)  # the captured size: eager at the same padded size
    names = _hf_move(model, move)
    refused(g.check_weights(), names)
    with pytest.raises(WeightsMovedError, match=re.escape(names[0])):
        g.generate(ids, mask, max_new_tokens=HF_NEW)
    g.recapture(reason=move, only_moved=True)
    current(g.check_weights(), model)
    want = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=HF_NEW,
        cache_implementation="static",
    )
    assert torch.equal(g.generate(ids, mask, max_new_tokens=HF_NEW), want)


# ------------------------------------------------------------------ continuous batching


@torch.no_grad()
def test_continuous_batching_serves_after_the_documented_recapture() -> None:
    F = _hf()
    pytest.importorskip("transformers.generation.continuous_batching")
    from tests.test_hf_continuous import graphed, hf_eager, run

    model = F.model("llama", seed=0)
    cb = graphed(model)
    try:
        run(cb)  # the step graphs of this call's keys
        names = _hf_move(model, "submodule replaced")
        for found in cb.check_weights():
            refused(found, names)
        with pytest.raises(WeightsMovedError) as info:  # refused before any step serves
            run(cb)
        assert set(names) & set(info.value.names)
        for e in cb.engines:
            e.runner.recapture(reason="down_proj replaced", only_moved=True)
        for found in cb.check_weights():
            current(found, model)
        assert run(cb) == hf_eager(model)
        for found in cb.check_weights():  # the keys captured by that call too
            current(found, model)
    finally:
        cb.close()


# ------------------------------------------------------------------ the same proof, reused


@torch.no_grad()
def test_an_update_after_a_submodule_is_replaced_writes_nothing() -> None:
    """A repeated update reuses its validated copy plan while the module's tree is
    provably the same; a replaced submodule ends the reuse, so the update is refused
    before any weight is written (it used to write the old module's tensors and the
    others, then raise)."""
    model = Tiny().eval()
    r = gg.GraphRunner(
        model, (torch.zeros(1, D),), sizes=[1, 2], backend=RecordingBackend(), progress=False
    )
    r.capture()
    sd = clones(model)
    r.update_weights(sd)
    r.update_weights(sd)  # the plan reused, the check before the copy skipped
    names = _submodule(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsMovedError, match="no weight changed") as info:
        r.update_weights({k: v + 1 for k, v in sd.items()})
    assert set(names) <= set(info.value.names)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------ the proof itself


def _swap_key(m: Tiny) -> None:  # the same count of keys: one gone, another registered
    del m.mlp[0].bias
    m.mlp[0].register_buffer("other", torch.zeros(D))


def _none_to_tensor(m: Tiny) -> None:  # a key registered as None given a tensor
    m.proj.bias = torch.nn.Parameter(torch.zeros(D))


def _child_added(m: Tiny) -> None:
    m.mlp.append(torch.nn.Linear(D, D))


def _parametrized(m: Tiny) -> None:  # the module had no tensor of its own dict before
    parametrize.remove_parametrizations(m.proj, "weight")


TREE_CHANGES: dict[str, Callable[[Tiny], Any]] = {
    "submodule replaced": _submodule,
    "parametrization removed": _parametrized,
    "a key swapped for another": _swap_key,
    "None given a tensor": _none_to_tensor,
    "a child added": _child_added,
}


@pytest.mark.parametrize("weak", [False, True])
@pytest.mark.parametrize("change", list(TREE_CHANGES))
def test_the_identity_proof_sees_every_change_of_the_tree(change: str, weak: bool) -> None:
    from graphguard.weights.record import Identity

    model = Tiny(parametrized=True)
    ident = Identity(model, weak=weak)
    assert ident.unchanged() and ident.intact()
    TREE_CHANGES[change](model)
    assert not ident.unchanged() and not ident.intact()
    assert Identity(model, weak=weak).intact()


def test_the_kept_identity_holds_no_replaced_submodule_alive() -> None:
    import gc
    import weakref

    from graphguard.weights.record import Weights

    model = Tiny()
    room = Weights("r", model)
    first = room.take()
    old = weakref.ref(model.mlp[2].weight)
    _submodule(model)
    gc.collect()
    assert old() is None, "the kept identity holds the replaced submodule's weight alive"
    assert not room.unchanged_since_last() and room.take() is not first
