"""Weights under live graphs on the CPU: update_weights (all or nothing, tied, buffers),
check_weights (every way of moving a parameter, by name), recapture of only the graphs
that read a moved tensor (the RecordingBackend's events say which sizes), PIECEWISE,
compile=True, the dispatcher and GraphedCausalLM.

The RecordingBackend's FULL replay re-runs the step, so "outputs equal eager" cannot
fail there for a moved weight: those tests assert on the captured addresses instead
(each captured storage holds the new values). A piece's replay re-runs its code on the
tensors captured with it, so PIECEWISE does serve a rebound weight's old values: there
the stale output is shown, then fixed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, GraphGuardError, WeightsMovedError
from graphguard.weights import WeightCheck, find_module

SIZES = [1, 2, 4, 8]


class Net(torch.nn.Module):
    """Two layers, a persistent and a non-persistent buffer, and a size-dependent branch:
    batches above 2 rows go through ``wide`` (so only the size-4 and size-8 graphs read it)."""

    def __init__(self, d: int = 6, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)
        self.wide = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.rand(d) + 0.5)
        self.register_buffer("shift", torch.rand(d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.scale + self.shift
        if x.shape[0] > 2:  # Python on the size: each graph records one branch
            h = h + self.wide(h)
        return self.b(h)


def runner(model: torch.nn.Module | None = None, **kw: Any) -> tuple[gg.GraphRunner, Any]:
    model = model if model is not None else Net()
    backend = kw.pop("backend", RecordingBackend())
    r = gg.GraphRunner(
        model, (torch.zeros(1, 6),), sizes=SIZES, backend=backend, progress=False, **kw
    )
    with torch.no_grad():
        r.capture()
    return r, backend


def new_state(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.state_dict().items()}


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {k: v.detach().clone() for k, v in named}


def addresses(model: torch.nn.Module) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def captured_sizes(backend: RecordingBackend) -> list[int]:
    return [e[1] for e in backend.events if e[0] == "capture_begin"]


# ------------------------------------------------------------------ update_weights


@pytest.mark.parametrize("sanitize", [False, True])
def test_update_copies_into_the_captured_storages_and_serves_the_new_weights(sanitize):
    r, _ = runner(sanitize=sanitize)
    model = r.fn
    before = addresses(model)
    sd = new_state(model)
    up = r.update_weights(sd)
    assert addresses(model) == before  # same storages: the graphs read the new values
    for k, v in sd.items():
        live = model.get_parameter(k) if "." in k else model.get_buffer(k)
        assert torch.equal(live, v), k
    assert set(up.copied) == set(sd) and up.bytes == sum(v.nbytes for v in sd.values())
    assert up.missing == () and up.recaptured == {} and up.seconds > 0
    with torch.no_grad():
        for n in (1, 3, 8):
            x = torch.randn(n, 6)
            torch.testing.assert_close(r(x), model(x))
    assert r.check_weights().ok
    if sanitize:
        r.check_storages()  # no false positive after a correct in-place update


def test_an_update_says_where_its_time_went():
    r, _ = runner()
    up = r.update_weights(new_state(r.fn))
    assert set(up.phases) == {"validate", "launch", "check", "wait", "settle"}
    assert all(v >= 0 for v in up.phases.values())
    assert sum(up.phases.values()) == pytest.approx(up.seconds, abs=2e-3)


def test_large_weights_are_copied_one_by_one_and_the_rest_fused(monkeypatch):
    """The split copy (a memcpy per large weight on CUDA), here with the CPU standing in
    for CUDA: every weight of at least MEMCPY_BYTES by its own copy_, the others in one
    _foreach_copy_, each value where it belongs, the plan's split kept for the next
    update."""
    from graphguard.weights import plan as P

    monkeypatch.setattr(P, "MEMCPY_DEVICES", ("cpu",))
    monkeypatch.setattr(P, "MEMCPY_BYTES", 6 * 6 * 4)  # [6, 6] float32 and larger
    r, _ = runner()
    model = r.fn
    sizes = {k: v.nbytes for k, v in model.state_dict().items()}
    big = {k for k, n in sizes.items() if n >= P.MEMCPY_BYTES}
    assert big and big != set(sizes)  # both kinds present
    fused: list[int] = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (fused.append(len(d)), real(d, s)))
    for seed in (1, 2):  # a new plan, then the kept one
        sd = new_state(model, seed)
        r.update_weights(sd)
        for k, v in sd.items():
            live = model.get_parameter(k) if "." in k else model.get_buffer(k)
            assert torch.equal(live, v), k
    assert fused == [len(sizes) - len(big)] * 2


def test_a_weight_re_laid_out_in_place_between_updates_is_refused_before_the_copy():
    # The second update would reuse the kept plan; a square weight transposed in place
    # keeps its object, address and shape (only the stride differs): not reused, refused.
    r, _ = runner()
    model = r.fn
    sd = new_state(model)  # one source, new values each time (an RL loop's weight sync)
    r.update_weights(sd)
    with torch.no_grad():
        for v in sd.values():
            v.add_(1)
    r.update_weights(sd)  # the kept plan, re-proved
    ptr = model.wide.weight.data_ptr()
    model.wide.weight.data = model.wide.weight.data.t()
    assert model.wide.weight.data_ptr() == ptr
    with torch.no_grad():
        for v in sd.values():
            v.add_(1)
    before = values(model)
    with pytest.raises(WeightsMovedError, match=r"(?s)wide.weight.*Found before copying"):
        r.update_weights(sd)
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing copied


def test_a_module_a_loader_and_a_loader_returning_a_state_dict_are_sources():
    r, _ = runner()
    model = r.fn
    other = Net(seed=7)
    up = r.update_weights(other)
    assert torch.equal(model.a.weight, other.a.weight)
    assert torch.equal(model.shift, other.shift)  # non-persistent: copied from a module
    assert "shift" in up.copied
    sd = new_state(model, seed=3)
    up = r.update_weights(lambda: model.load_state_dict(sd))  # loads in place itself
    assert up.loaded_by_callable and up.copied == () and torch.equal(model.b.bias, sd["b.bias"])
    sd = new_state(model, seed=4)
    up = r.update_weights(lambda: sd)
    assert not up.loaded_by_callable and torch.equal(model.b.bias, sd["b.bias"])


def _bad(kind: str, sd: dict[str, torch.Tensor]) -> str:
    if kind == "shape":
        sd["wide.weight"] = torch.zeros(6, 5)
        return r"wide\.weight: expected float32 \[6, 6\], got float32 \[6, 5\]"
    if kind == "dtype":
        sd["b.bias"] = sd["b.bias"].double()
        return r"b\.bias: expected float32 \[6\], got float64 \[6\]"
    if kind == "unknown":
        sd["a.wieght"] = sd["a.weight"]
        return r"a\.wieght \(did you mean 'a\.weight'\?\)"
    if kind == "missing":
        del sd["scale"]
        return r"does not give: scale"
    if kind == "tied":
        raise AssertionError
    sd["a.weight"] = "not a tensor"  # type: ignore[assignment]
    return r"a\.weight: expected a tensor, got str"


@pytest.mark.parametrize("kind", ["shape", "dtype", "unknown", "missing", "not_a_tensor"])
def test_a_mismatch_is_a_config_error_naming_it_and_no_weight_changes(kind):
    r, _ = runner()
    model = r.fn
    before = values(model)
    sd = new_state(model)
    pattern = _bad(kind, sd)
    with pytest.raises(ConfigError, match=pattern) as info:
        r.update_weights(sd)
    assert "no weight changed" in str(info.value)
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_every_problem_is_listed_at_once():
    r, _ = runner()
    sd = new_state(r.fn)
    sd["a.weight"] = torch.zeros(2, 2)
    sd["b.weight"] = torch.zeros(6, 6, dtype=torch.float16)
    sd["nope"] = torch.zeros(1)
    with pytest.raises(ConfigError) as info:
        r.update_weights(sd)
    text = str(info.value)
    assert "a.weight" in text and "b.weight" in text and "nope" in text


def test_strict_false_updates_a_subset_and_lists_ignored_and_missing():
    r, _ = runner()
    model = r.fn
    before = values(model)
    new = torch.randn(6, 6)
    up = r.update_weights({"a.weight": new, "extra.thing": torch.zeros(1)}, strict=False)
    assert up.copied == ("a.weight",) and up.ignored == ("extra.thing",)
    assert "b.weight" in up.missing and "shift" not in up.missing  # non-persistent: optional
    assert torch.equal(model.a.weight, new) and torch.equal(model.b.weight, before["b.weight"])


@pytest.mark.parametrize("strict", [True, False])
def test_a_source_key_that_is_not_a_name_is_refused_naming_it_and_its_type(strict):
    """A non-string key raised difflib's raw ``TypeError`` (the unknown-name hints)."""
    r, _ = runner()
    model = r.fn
    before = values(model)
    sd: dict[Any, torch.Tensor] = dict(new_state(model))
    sd[3] = torch.zeros(6, 6)
    sd[("a", "weight")] = torch.zeros(6, 6)
    with pytest.raises(ConfigError, match=r"keys must be names \(str\)") as info:
        r.update_weights(sd, strict=strict)
    text = str(info.value)
    assert "2 key(s) are not: 3 (int), ('a', 'weight') (tuple)" in text
    assert "no weight changed" in text
    assert all(torch.equal(before[k], v) for k, v in values(model).items())


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one storage, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def test_tied_weights_are_copied_once_and_conflicting_values_are_refused():
    model = Tied()
    r = gg.GraphRunner(
        model,
        (torch.zeros(1, dtype=torch.long),),
        sizes=[1, 2],
        backend=RecordingBackend(),
        progress=False,
    )
    with torch.no_grad():
        r.capture()
    w = torch.randn(10, 4)
    up = r.update_weights({"embed.weight": w, "head.weight": w.clone()})  # equal values
    assert up.copied == ("embed.weight",) and up.bytes == w.nbytes
    assert torch.equal(model.head.weight, w) and model.head.weight is model.embed.weight
    up = r.update_weights({"head.weight": w * 2})  # one name of the pair is enough
    assert torch.equal(model.embed.weight, w * 2)
    with pytest.raises(ConfigError, match=r"tied .* different values"):
        r.update_weights({"embed.weight": w, "head.weight": w + 1})
    assert torch.equal(model.embed.weight, w * 2)
    assert r.check_weights().checked == 2  # both names are proven


def _tied_runner() -> tuple[gg.GraphRunner, Tied]:
    model = Tied()
    r = gg.GraphRunner(
        model,
        (torch.zeros(1, dtype=torch.long),),
        sizes=[1, 2],
        backend=RecordingBackend(),
        progress=False,
    )
    with torch.no_grad():
        r.capture()
    return r, model


@pytest.mark.parametrize("bad", ["head.weight", "embed.weight"])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("shape", "expected float32 [10, 4], got float32 [4, 10]"),
        ("dtype", "expected float32 [10, 4], got float64 [10, 4]"),
        ("not_a_tensor", "expected a tensor, got list"),
    ],
    ids=["shape", "float64", "not_a_tensor"],
)
def test_a_tied_name_is_checked_on_its_own_even_when_the_other_name_is_fine(
    bad: str, kind: str, message: str
) -> None:
    """Both names of a tied pair given: the one with the wrong shape, float64 (equal
    values: a value comparison alone would let it through) or no tensor at all is refused,
    named, with what was expected, whichever of the two it is; nothing is copied."""
    r, model = _tied_runner()
    w = torch.randn(10, 4)
    r.update_weights({"embed.weight": w, "head.weight": w.clone()})  # the pair, both fine
    before = values(model)
    fine = torch.randn(10, 4)
    alias: Any = {
        "shape": fine.t().contiguous(),
        "dtype": fine.double(),
        "not_a_tensor": fine.tolist(),
    }[kind]
    good = "embed.weight" if bad == "head.weight" else "head.weight"
    with pytest.raises(ConfigError) as info:
        r.update_weights({good: fine, bad: alias})
    text = str(info.value)
    assert f"  - {bad}: {message}\n" in text and "no weight changed" in text, text
    assert good + ":" not in text and "different values" not in text, text
    after = values(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.head.weight is model.embed.weight
    up = r.update_weights({good: fine, bad: fine.clone()})  # fixed: accepted
    assert torch.equal(model.embed.weight, fine) and up.bytes == fine.nbytes


def test_on_moved_is_validated_and_the_module_must_be_found():
    r, _ = runner()
    with pytest.raises(ConfigError, match="on_moved must be"):
        r.update_weights({}, on_moved="ignore", strict=False)
    m1, m2 = Net(), Net()

    def two(x: torch.Tensor) -> torch.Tensor:
        return m1(x) + m2(x)

    r2 = gg.GraphRunner(
        two, (torch.zeros(1, 6),), sizes=[1], backend=RecordingBackend(), progress=False
    )
    with pytest.raises(ConfigError, match="weights=model"):
        r2.update_weights({})
    r3 = gg.GraphRunner(
        two,
        (torch.zeros(1, 6),),
        sizes=[1],
        backend=RecordingBackend(),
        progress=False,
        options=gg.CaptureOptions(weights=m2),
    )
    with torch.no_grad():
        r3.capture()
    assert r3.check_weights().checked == len(values(m2))
    r4 = gg.GraphRunner(
        two,
        (torch.zeros(1, 6),),
        sizes=[1],
        backend=RecordingBackend(),
        progress=False,
        options=gg.CaptureOptions(weights="m2"),
    )
    with torch.no_grad():
        r4.capture()  # the capture itself is unaffected
    with pytest.raises(ConfigError, match="weights= is a str"):
        r4.check_weights()


def test_find_module_sees_through_closures_bound_methods_and_engines():
    model = Net()

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    class Engine:
        def __init__(self) -> None:
            self.model = model
            self.calls = 0

        def step(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    assert find_module(model) is model
    assert find_module(step) is model
    assert find_module(model.forward) is model
    assert find_module(Engine().step) is model
    assert find_module(lambda x: x) is None


def test_mode_none_updates_and_has_nothing_to_check():
    model = Net()
    r = gg.GraphRunner(model, (torch.zeros(1, 6),), sizes=SIZES, mode="none", progress=False)
    r.capture()
    sd = new_state(model)
    r.update_weights(sd)
    assert torch.equal(model.a.weight, sd["a.weight"]) and r.check_weights().ok


def test_check_before_capture_is_an_error():
    r = gg.GraphRunner(
        Net(), (torch.zeros(1, 6),), sizes=SIZES, backend=RecordingBackend(), progress=False
    )
    with pytest.raises(GraphGuardError, match="before capture"):
        r.check_weights()


# ------------------------------------------------------------------ check_weights


def _rebind_data(m: Net) -> str:
    m.a.weight.data = m.a.weight.data.clone()
    return "a.weight"


def _new_parameter(m: Net) -> str:
    m.b.weight = torch.nn.Parameter(m.b.weight.detach().clone())
    return "b.weight"


def _contiguous(m: Net) -> str:
    # A loader that re-lays a weight out (a fused-qkv re-shuffle): transposed and back.
    m.wide.weight.data = m.wide.weight.data.t().contiguous().t()
    return "wide.weight"


def _to_dtype(m: Net) -> str:
    m.a.to(torch.float64)
    return "a.weight"


def _resized_buffer(m: Net) -> str:
    m.scale.resize_(64)  # grows the storage: a new allocation
    return "scale"


def _paused_storage(m: Net) -> str:
    # A memory saver's pause/resume: the storage freed, then allocated again elsewhere.
    saved = m.scale.clone()
    st = m.scale.untyped_storage()
    nbytes = st.nbytes()
    st.resize_(0)
    hold = torch.empty(nbytes, dtype=torch.uint8)  # takes the freed block meanwhile
    st.resize_(nbytes)
    del hold
    m.scale.copy_(saved)
    return "scale"


def _new_buffer(m: Net) -> str:
    m.register_buffer("shift", m.shift.clone(), persistent=False)
    return "shift"


MOVERS: dict[str, Callable[[Net], str]] = {
    "param.data = new": _rebind_data,
    "module.weight = Parameter(...)": _new_parameter,
    ".contiguous() re-materialisation": _contiguous,
    ".to(dtype)": _to_dtype,
    "resized buffer": _resized_buffer,
    "storage paused and resumed": _paused_storage,
    "re-created buffer": _new_buffer,
}


@pytest.mark.parametrize("how", list(MOVERS))
def test_check_weights_names_every_way_of_moving_a_tensor(how):
    r, _ = runner()
    assert r.check_weights().ok
    name = MOVERS[how](r.fn)
    found = r.check_weights()
    assert [m.name for m in found.moved if m.name == name] == [name]
    if how == ".to(dtype)":
        assert {m.name for m in found.moved} == {"a.weight", "a.bias"}
        assert "dtype float32 -> float64" in found.moved[0].change
    else:
        assert [m.name for m in found.moved] == [name]
    assert not found and found.sizes == tuple(SIZES) and not found.reads_known
    with pytest.raises(WeightsMovedError, match=name.replace(".", r"\.")) as info:
        found.raise_if_moved()
    assert name in info.value.names
    before = values(r.fn)
    with pytest.raises(WeightsMovedError, match="no weight changed"):
        r.update_weights(new_state(Net()), strict=False)
    after = values(r.fn)
    for k in before:  # bit for bit; a resized buffer's new elements may be NaN garbage
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, equal_nan=True)


def test_check_weights_is_cheap(record_property):
    """About 150 tensors (a 1B Llama has 146): a Python loop, well under a millisecond
    each call on any CPU; the figure is recorded."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(75)])
    r = gg.GraphRunner(
        model, (torch.zeros(1, 4),), sizes=[1, 2], backend=RecordingBackend(), progress=False
    )
    with torch.no_grad():
        r.capture()
    assert r.check_weights().checked == 150
    t0 = time.perf_counter()
    for _ in range(50):
        r.check_weights()
    us = (time.perf_counter() - t0) / 50 * 1e6
    record_property("check_weights_us_150_tensors", us)
    assert us < 5000, f"check_weights of 150 tensors took {us:.0f} us"


# ------------------------------------------------------------------ recapture only what must be


def test_with_the_sanitizer_only_the_graphs_that_read_a_moved_weight_are_recaptured():
    r, backend = runner(sanitize=True)
    model = r.fn
    model.wide.weight = torch.nn.Parameter(torch.randn(6, 6))
    found = r.check_weights()
    assert found.reads_known and found.sizes == (4, 8)  # sizes 1 and 2 never read wide
    assert found.moved[0].sizes == (4, 8)
    backend.events.clear()
    report = r.recapture(reason="wide replaced", only_moved=True)
    assert captured_sizes(backend) == [8, 4] and sorted(report.captured) == [4, 8]
    assert r.check_weights().ok and r.captured_sizes == tuple(SIZES)
    with torch.no_grad():
        for n in (1, 2, 3, 8):  # every size replays, none raises a sanitizer error
            x = torch.randn(n, 6)
            torch.testing.assert_close(r(x), model(x))
    r.check_storages()


def test_a_moved_weight_no_graph_reads_recaptures_nothing():
    r, backend = runner(sanitize=True)
    r.fn.register_buffer("unused", torch.zeros(3))
    r.check_weights()  # not in the record: no graph reads a tensor born after capture
    backend.events.clear()
    assert r.recapture(reason="nothing", only_moved=True).captured == []
    assert captured_sizes(backend) == []


def test_without_the_sanitizer_every_size_is_recaptured_and_the_reason_says_so(caplog):
    r, backend = runner()
    r.fn.wide.weight = torch.nn.Parameter(torch.randn(6, 6))
    backend.events.clear()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r.recapture(reason="wide replaced", only_moved=True)
    assert captured_sizes(backend) == [8, 4, 2, 1]
    assert "which graph reads what is not known" in caplog.text
    assert "wide.weight" in caplog.text
    assert r.check_weights().ok


def test_update_with_on_moved_recapture_recaptures_what_the_loader_moved():
    r, backend = runner(sanitize=True)
    model = r.fn
    sd = new_state(model)

    def loader() -> None:  # a loader that assigns (load_state_dict(assign=True) style)
        model.load_state_dict(sd, assign=True)

    with pytest.raises(WeightsMovedError, match="loader moved"):
        r.update_weights(loader)
    backend.events.clear()
    up = r.update_weights(lambda: None, on_moved="recapture", strict=False)
    assert up.recaptured == {"GraphRunner(Net)": (1, 2, 4, 8)}
    assert {m.name for m in up.moved} >= {"a.weight", "wide.weight", "scale"}
    assert captured_sizes(backend) == [8, 4, 2, 1]
    assert r.check_weights().ok
    with torch.no_grad():
        x = torch.randn(3, 6)
        torch.testing.assert_close(r(x), model(x))


# ------------------------------------------------------------------ PIECEWISE, compile=True


@torch.library.custom_op("gg_weights_test::mix", mutates_args=())
def mix(x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ mem.t(), dim=-1) @ mem


@mix.register_fake
def _(x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Split(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 6)
        self.mem = torch.nn.Parameter(torch.randn(5, 6))
        self.out = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.gg_weights_test.mix(torch.tanh(self.inp(x)), self.mem)
        return self.out(h) + x


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def test_piecewise_update_in_place_serves_new_weights_and_a_rebind_is_found_and_fixed(
    fresh_dynamo,
):
    model = Split()
    backend = RecordingBackend()
    r = gg.PiecewiseRunner(
        model,
        (torch.zeros(1, 6),),
        split_ops=[torch.ops.gg_weights_test.mix],
        sizes=[1, 2, 4],
        backend=backend,
        progress=False,
    )
    r.capture()
    x = torch.randn(3, 6)
    r.update_weights(new_state(model, seed=5))
    torch.testing.assert_close(r(x), model(x))
    # A rebind: the pieces replay the tensor they were captured with, the old one.
    model.out.weight = torch.nn.Parameter(torch.randn(6, 6))
    assert not torch.allclose(r(x), model(x))
    found = r.check_weights()
    assert [m.name for m in found.moved] == ["out.weight"] and found.reads_known
    assert found.sizes == (1, 2, 4)  # every size's last piece reads it
    backend.events.clear()
    r.recapture(reason="out replaced", only_moved=True)
    assert sorted({e[1][0] for e in backend.events if e[0] == "capture_begin"}) == [1, 2, 4]
    torch.testing.assert_close(r(x), model(x))
    assert r.check_weights().ok


@pytest.mark.compile
@torch.no_grad()
def test_compiled_runner_reads_updated_weights_not_constants(fresh_dynamo):
    """dynamo lifts module parameters as graph inputs (torch >= 2.5), so an in-place
    update reaches the compiled code; a rebind is recaptured (a recompile is allowed)."""
    model = Net()
    r = gg.GraphRunner(
        model,
        (torch.zeros(1, 6),),
        sizes=[2, 4],
        compile=True,
        backend=RecordingBackend(),
        progress=False,
    )
    r.capture()
    x = torch.randn(3, 6)
    before = r(x).clone()
    r.update_weights(new_state(model, seed=9))
    out = r(x)
    assert not torch.allclose(out, before)
    torch.testing.assert_close(out, model(x))
    model.b.weight = torch.nn.Parameter(torch.randn(6, 6))
    r.update_weights(lambda: None, on_moved="recapture", strict=False)
    torch.testing.assert_close(r(x), model(x))
    assert r.check_weights().ok


@pytest.mark.compile
def test_compiled_runner_with_inductor_freezing_is_refused(fresh_dynamo):
    import torch._inductor.config as inductor_config

    model = Net()
    r = gg.GraphRunner(
        model,
        (torch.zeros(1, 6),),
        sizes=[2],
        compile=True,
        backend=RecordingBackend(),
        progress=False,
    )
    with inductor_config.patch(freezing=True), pytest.raises(ConfigError, match="freezing"):
        r.update_weights(new_state(model))


@torch.no_grad()
def test_dispatcher_updates_the_shared_model_once_and_checks_both_runners(fresh_dynamo):
    from graphguard.dispatch import Dispatcher, DispatchPlan

    model = Split()
    full = gg.GraphRunner(
        model, (torch.zeros(1, 6),), sizes=[1, 2], backend=RecordingBackend(), progress=False
    )
    pw = gg.PiecewiseRunner(
        model,
        (torch.zeros(1, 6),),
        split_ops=[torch.ops.gg_weights_test.mix],
        sizes=[1, 2, 4],
        backend=RecordingBackend(),
        progress=False,
    )
    plan = DispatchPlan(
        "full_and_piecewise", max_tokens=8, full_sizes=[1, 2], piecewise_sizes=[1, 2, 4]
    )
    d = Dispatcher(plan, eager=model, full=full, piecewise=pw)
    d.capture()
    sd = new_state(model, seed=2)
    up = d.update_weights(sd)
    assert sorted(up.copied) == sorted(sd)  # one copy for the model both runners read
    assert torch.equal(model.mem, sd["mem"])
    checks = d.check_weights()
    assert set(checks) == {"full", "piecewise"} and all(
        isinstance(c, WeightCheck) and c.ok for c in checks.values()
    )
    model.mem = torch.nn.Parameter(torch.randn(5, 6))
    assert all(not c.ok for c in d.check_weights().values())
    up = d.update_weights(lambda: None, on_moved="recapture", strict=False)
    # mem feeds the split op, which runs eagerly: no piece graph reads it, so only the
    # FULL graphs are recaptured and the piecewise record is simply taken again.
    assert up.recaptured == {"GraphRunner(Split)": (1, 2)}
    assert all(c.ok for c in d.check_weights().values())
    torch.testing.assert_close(full(x := torch.randn(2, 6)), model(x))
    x = torch.randn(3, 6)
    torch.testing.assert_close(pw(x), model(x))


# ------------------------------------------------------------------ GraphedCausalLM (HF names)

HF_CACHE = 40
HF_NEW = 6


def _hf() -> tuple[Any, Any]:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families

    return GraphedCausalLM, hf_families


def _graphed(model: Any, **kw: Any) -> Any:
    GraphedCausalLM, _ = _hf()
    g = GraphedCausalLM(
        model,
        max_batch=4,
        max_cache_len=HF_CACHE,
        backend=RecordingBackend(),
        progress=False,
        **kw,
    )
    g.capture()
    return g


def _hf_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=HF_NEW,
        cache_implementation="static",
    )
    return out


@pytest.mark.parametrize("via", ["state_dict", "module", "safetensors_dir", "base_model_names"])
def test_graphed_causal_lm_updates_with_hf_names_and_generates_like_the_new_model(via, tmp_path):
    _, F = _hf()
    model = F.model("llama", seed=0)
    other = F.model("llama", seed=1)
    g = _graphed(model)
    ids, mask = F.prompts(2, seed=3)
    want = _hf_generate(other, ids, mask)
    assert not torch.equal(g.generate(ids, mask, max_new_tokens=HF_NEW), want)
    before = addresses(model)
    if via == "state_dict":
        source: Any = other.state_dict()
    elif via == "module":
        source = other
    elif via == "safetensors_dir":
        other.save_pretrained(tmp_path)
        source = tmp_path
    else:  # saved from the base model: "layers.0..." for "model.layers.0..."
        source = {
            (k[len("model.") :] if k.startswith("model.") else k): v
            for k, v in other.state_dict().items()
        }
    up = g.update_weights(source)
    assert addresses(model) == before and up.recaptured == {}
    assert g.check_weights().ok
    assert torch.equal(g.generate(ids, mask, max_new_tokens=HF_NEW), want)


def test_graphed_gpt2_checkpoint_without_its_tied_head_loads(tmp_path):
    _, F = _hf()
    model = F.model("gpt2", seed=0)
    other = F.model("gpt2", seed=1)
    other.save_pretrained(tmp_path)  # lm_head.weight is tied to wte: not saved
    g = _graphed(model)
    g.update_weights(tmp_path / "model.safetensors")
    assert torch.equal(model.lm_head.weight, other.transformer.wte.weight)
    ids, mask = F.prompts(2, seed=4)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=HF_NEW), _hf_generate(other, ids, mask))


def test_graphed_causal_lm_moved_weight_is_named_and_recaptured_with_the_cache_restored():
    _, F = _hf()
    model = F.model("llama", seed=0)
    g = _graphed(model)
    ids, mask = F.prompts(2, seed=5)
    cache = [t.clone() for t in g.cache_state.tensors]  # the KV cache and its counters
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)
    found = g.check_weights()
    assert [m.name for m in found.moved] == ["lm_head.weight"]
    with pytest.raises(WeightsMovedError, match=r"lm_head\.weight"):
        g.update_weights(F.model("llama", seed=2).state_dict())
    up = g.update_weights(lambda: None, on_moved="recapture", strict=False)
    assert up.recaptured and g.check_weights().ok
    assert all(torch.equal(a, b) for a, b in zip(cache, g.cache_state.tensors, strict=True))
    assert torch.equal(g.generate(ids, mask, max_new_tokens=HF_NEW), _hf_generate(model, ids, mask))


def test_graphed_causal_lm_bad_checkpoint_path_is_a_config_error(tmp_path):
    _, F = _hf()
    g = _graphed(F.model("llama", seed=0))
    with pytest.raises(ConfigError, match=r"no \.safetensors file"):
        g.update_weights(tmp_path)
    with pytest.raises(ConfigError, match="neither"):
        g.update_weights(tmp_path / "missing.safetensors")
