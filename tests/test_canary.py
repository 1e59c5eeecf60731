"""The replay canary on the CPU (RecordingBackend): the check, exactness, stats, modes,
poisoned padding, the refusal, and the planted bugs a body-re-running emulation can show.

The RecordingBackend replays by re-running the captured Python body, so bugs that live in
what a real graph froze (a baked Python scalar, a rebound weight, a re-created buffer, a
capture-time branch) cannot show here: those are in tests/gpu/test_canary_gpu.py. Here:
bugs in the data a replay reads that eager does not (padded rows, an unregistered
generator, a per-shape cache filled on the first call at each shape).
"""

from __future__ import annotations

import logging

import pytest
import torch

import graphguard as gg
from graphguard.errors import ConfigError, DivergenceError
from graphguard.report import VerifyReport

SIZES = [2, 4, 8]


class Acc(torch.nn.Module):
    """A correct stateful step: a per-row accumulator and a step counter (in place)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=g))
        self.register_buffer("acc", torch.zeros(8, d))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        self.acc[:n] += x
        self.steps += 1
        return torch.tanh(x @ self.w) + self.acc[:n] + self.steps


class Leaky(torch.nn.Module):
    """Real rows read the padded rows: each row adds the batch-wide mean (padded rows
    included), so with harmless zero fills the mean is diluted, but never NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.0 * x.sum(0, keepdim=True)


class Unregistered(torch.nn.Module):
    """Noise from a generator graphguard cannot find (held in a closure, not an attribute)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self._draw = lambda shape: torch.rand(shape, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._draw(x.shape)


class ShapeCache(torch.nn.Module):
    """A Python number frozen per shape on the first call at that shape (the pattern of
    a plan cache keyed by shape): the graph's shape froze it at capture; eager's batch,
    first seen later, reads the host value of now."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self._frozen: dict[tuple[int, ...], float] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self._frozen.setdefault(tuple(x.shape), self.scale)
        return x * s


def make(model, example=None, **kw):
    kw.setdefault("sizes", SIZES)
    kw.setdefault("backend", gg.RecordingBackend())
    kw.setdefault("progress", False)
    r = gg.GraphRunner(model, example or (torch.randn(8, 4),), **kw)
    with torch.no_grad():
        r.capture()
    return r


def x_(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- options


def test_canary_arguments_are_checked_with_the_fix():
    with pytest.raises(ConfigError, match="every"):
        gg.Canary(every=0)
    with pytest.raises(ConfigError, match="every"):
        gg.Canary(every=True)
    with pytest.raises(ConfigError, match="on_divergence"):
        gg.Canary(on_divergence="log")
    with pytest.raises(ConfigError, match="rtol"):
        gg.Canary(rtol=-1.0)
    with pytest.raises(ConfigError, match="poison_padding"):
        gg.Canary(poison_padding="x")
    with pytest.raises(ConfigError, match=r"graphguard\.Canary"):
        gg.CaptureOptions(canary=1000)
    assert gg.Canary(poison_padding=["x"]).poison_padding == ("x",)


def test_without_a_canary_the_stats_are_empty_and_nothing_is_checked():
    m = Acc()
    r = make(m, state=m)
    with torch.no_grad():
        for _ in range(5):
            r(x_(4))
    assert r.canary_stats() == {}
    assert r.door.entries[4].countdown == -5  # the one decrement, never reaching 0


# ----------------------------------------------------------------- the check itself


def test_every_nth_call_of_each_size_is_checked_and_counted():
    m = Acc()
    r = make(m, state=m, canary=gg.Canary(every=3))
    with torch.no_grad():
        for _ in range(7):
            r(x_(4))
        for _ in range(3):
            r(x_(2))
    stats = r.canary_stats()
    assert sorted(stats) == SIZES
    assert (stats[4].checks, stats[2].checks, stats[8].checks) == (2, 1, 0)
    assert all(s.divergences == 0 and s.last is None for s in stats.values())
    assert stats[4].to_dict()["checks"] == 2


def test_no_false_positive_over_many_checks_on_a_correct_stateful_step():
    m = Acc()
    r = make(m, state=m, canary=gg.Canary(every=1, on_divergence="raise"))
    with torch.no_grad():
        for i in range(300):
            r(x_(1 + i % 8, seed=i))
    stats = r.canary_stats()
    assert sum(s.checks for s in stats.values()) == 300
    assert sum(s.divergences for s in stats.values()) == 0


def test_the_stats_keep_the_worst_difference_of_passing_checks_too():
    """``max_abs``/``max_rel``: how close to the tolerance serving runs (a soak reports
    them). A frozen per-shape number off by 1e-6 passes fp32's tolerance but shows."""
    m = ShapeCache()
    r = make(m, state=[], canary=gg.Canary(every=1))
    m.scale = 1.0 + 1e-6  # eager's batch of 3 is a new shape: it reads this
    with torch.no_grad():
        r(x_(3))
    st = r.canary_stats()[4]
    assert (st.checks, st.divergences) == (1, 0)
    assert 0.0 < st.max_abs < 1e-5 and 0.0 < st.max_rel < 1e-4
    m.scale = 2.0
    with torch.no_grad():
        r(x_(5))  # pads to 8; a new shape again
    st8 = r.canary_stats()[8]
    assert st8.divergences == 1 and st8.max_abs > 0.1
    assert r.canary_stats()[4].max_abs == st.max_abs  # per size
    assert {"max_abs", "max_rel"} <= set(st8.to_dict())


def test_a_checked_call_leaves_exactly_what_a_plain_call_leaves():
    a, b = Acc(), Acc()
    plain = make(a, state=a)
    checked = make(b, state=b, canary=gg.Canary(every=1))
    with torch.no_grad():
        for i in range(20):
            x = x_(1 + i % 8, seed=i)
            assert torch.equal(plain(x), checked(x))
            assert torch.equal(a.acc, b.acc) and torch.equal(a.steps, b.steps)


def test_a_diverging_checked_call_still_leaves_the_graphs_state_not_eagers():
    """ "warn": the caller keeps what the replay wrote, even where eager would differ."""

    class FrozenAcc(ShapeCache):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            self.total += y.sum(0)
            return y

    a, b = FrozenAcc(), FrozenAcc()
    plain = make(a, state=a, fill_values=0.0)
    checked = make(b, state=b, canary=gg.Canary(every=1))
    a.scale = b.scale = 3.0
    with torch.no_grad():
        for i in range(4):
            x = x_(3, seed=i)
            assert torch.equal(plain(x), checked(x))
    assert checked.canary_stats()[4].divergences == 4
    assert torch.equal(a.total, b.total)


def test_a_checked_call_leaves_generators_where_the_replay_left_them():
    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = torch.Generator().manual_seed(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand(x.shape, generator=self.gen)

    p, c = Noisy(), Noisy()
    plain = make(p, state=[])
    checked = make(c, state=[], canary=gg.Canary(every=1, on_divergence="raise"))
    with torch.no_grad():
        for i in range(6):
            x = x_(3, seed=i)
            assert torch.equal(plain(x), checked(x))
    assert torch.equal(p.gen.get_state(), c.gen.get_state())


def test_the_zero_copy_path_is_checked_too():
    m = Acc()
    r = make(m, state=m, canary=gg.Canary(every=2, on_divergence="raise"))
    with torch.no_grad():
        for i in range(4):
            r.static_inputs(3)[0].copy_(x_(3, seed=i))
            r.replay(3)
    assert r.canary_stats()[4].checks == 2


# ----------------------------------------------------------- on_divergence modes


def _diverging(how, **kw):
    m = ShapeCache()
    r = make(m, state=[], canary=gg.Canary(every=1, on_divergence=how), **kw)
    m.scale = 3.0  # host state changes after capture; size 4's graph keeps 1.0
    return r, m


def test_warn_logs_once_per_size_and_counts_every_divergence(caplog):
    r, _ = _diverging("warn")
    with caplog.at_level(logging.WARNING, logger="graphguard"), torch.no_grad():
        for _ in range(3):
            r(x_(3))
    msgs = [rec.getMessage() for rec in caplog.records if "canary" in rec.getMessage()]
    assert len(msgs) == 1 and "size 4" in msgs[0]
    st = r.canary_stats()[4]
    assert (st.checks, st.divergences) == (3, 3)
    assert isinstance(st.last, VerifyReport) and st.last.sizes[0].batch == 3


def test_raise_names_the_size_the_batch_and_the_output_leaf():
    r, _ = _diverging("raise")
    with pytest.raises(DivergenceError, match="size 4") as info, torch.no_grad():
        r(x_(3))
    report = info.value.report
    assert report is not None and report.failed == [4]
    check = report.sizes[0]
    assert (check.batch, check.graph, check.worst_leaf) == (3, 4, 0)
    assert check.max_abs > 0.1


def test_a_callable_receives_the_report():
    seen: list[VerifyReport] = []
    r, _ = _diverging(seen.append)
    with torch.no_grad():
        r(x_(3))
        r(x_(4))  # the size-4 batch itself: eager hits the same frozen entry
    assert len(seen) == 1 and seen[0].failed == [4]


def test_eager_serves_the_size_eagerly_from_then_on_and_says_so_once(caplog):
    r, _ = _diverging("eager")
    backend = r.backend
    x = x_(3)
    with caplog.at_level(logging.WARNING, logger="graphguard"), torch.no_grad():
        first = r(x).clone()
        replays = backend.names().count("replay")
        later = [r(x_(3, seed=i)).clone() for i in range(3)]
    assert torch.allclose(first, x * 3.0)  # the diverging call already returns eager's
    assert backend.names().count("replay") == replays  # no replay of size 4 since
    assert all(torch.allclose(y, x_(3, seed=i) * 3.0) for i, y in enumerate(later))
    assert r.canary_stats()[4].eager
    assert sum("eagerly from now on" in rec.getMessage() for rec in caplog.records) == 1
    with torch.no_grad():  # other sizes still replay
        r(x_(8))
    assert backend.names().count("replay") == replays + 1


# -------------------------------------------------------------- planted bugs (CPU)


def test_corpus_real_rows_reading_padded_rows_caught_only_with_poisoned_padding():
    calm = make(Leaky(), state=[], canary=gg.Canary(every=1))
    with torch.no_grad():
        calm(x_(3))
    assert calm.canary_stats()[4].divergences == 0  # zero fills hide it
    poisoned = make(Leaky(), state=[], canary=gg.Canary(every=1, poison_padding=True))
    with torch.no_grad():
        out = poisoned(x_(3)).clone()
        after = poisoned(x_(3)).clone()
    st = poisoned.canary_stats()[4]
    assert st.divergences == 2 and st.last is not None
    assert st.last.sizes[0].batch == 3 and st.last.sizes[0].worst_leaf == 0
    # The caller gets the replay with harmless fills; the poison is gone afterwards.
    assert not torch.isnan(out).any() and not torch.isnan(after).any()
    torch.testing.assert_close(out, calm(x_(3)))
    assert not torch.isnan(poisoned.static.buffers[0][3:]).any()


def test_corpus_padding_is_poisoned_for_checks_only_and_sanitize_poisons_floats():
    r = make(Leaky(), state=[], canary=gg.Canary(every=2))
    with torch.no_grad():
        assert not torch.isnan(r(x_(3))).any()  # call 1: not checked, zero fills
    assert r.canary_stats()[4].checks == 0
    s = make(Leaky(), state=[], canary=gg.Canary(every=1), sanitize=True)
    with torch.no_grad():
        s(x_(3))
    assert s.canary_stats()[4].divergences == 1


def test_corpus_poisoned_integer_padding_that_indexes_is_a_divergence_not_a_crash():
    table = torch.randn(10, 4)

    def lookup(tok: torch.Tensor) -> torch.Tensor:
        return table[tok] + 0.0 * table[tok].sum(0)

    r = make(
        lookup,
        (torch.zeros(8, dtype=torch.int64),),
        state=[],
        canary=gg.Canary(every=1, poison_padding=True),
    )
    tok = torch.tensor([1, 2, 3])
    with torch.no_grad():
        out = r(tok)
    torch.testing.assert_close(out, table[tok])  # served from the clean replay
    st = r.canary_stats()[4]
    assert st.divergences == 1 and "poisoned padding raised" in st.last.sizes[0].note
    with pytest.raises(ConfigError, match=r"\['tokens'\].*not inputs.*input\[0\]"):
        gg.GraphRunner(
            lookup,
            (torch.zeros(8, dtype=torch.int64),),
            backend=gg.RecordingBackend(),
            canary=gg.Canary(poison_padding=["tokens"]),
        )


def test_corpus_rng_from_an_unregistered_generator():
    r = make(Unregistered(), state=[], canary=gg.Canary(every=1))
    with torch.no_grad():
        r(x_(4))
    assert r.canary_stats()[4].divergences == 1


def test_corpus_python_number_frozen_per_shape_at_capture():
    r, m = _diverging("warn")
    with torch.no_grad():
        r(x_(3))
    assert r.canary_stats()[4].divergences == 1
    m.scale = 1.0  # back to the frozen value: nothing to see
    r2, m2 = _diverging("warn")
    m2.scale = 1.0
    with torch.no_grad():
        r2(x_(3))
    assert r2.canary_stats()[4].divergences == 0


def test_corpus_a_state_write_the_graph_does_wrong_is_caught_in_the_state():
    class Drift(torch.nn.Module):
        """The replayed state update differs from eager's (it reads the padded rows)."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total += x.sum(0)
            return x * 2

    m = Drift()
    r = make(m, state=m, canary=gg.Canary(every=1, poison_padding=True), fill_values=1.0)
    with torch.no_grad():
        r(x_(3))
    note = r.canary_stats()[4].last.sizes[0].note
    assert "state total" in note


def test_corpus_an_input_write_the_graph_does_wrong_is_caught_while_the_outputs_agree():
    """A step that writes its input in place (as a decode step advances its positions):
    the graph's write froze a Python number at capture, eager's reads the host value of
    now, and the output (computed before the write) is the same on both paths. Only the
    comparison of the caller's written inputs shows it."""

    class Advance(ShapeCache):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self._frozen.setdefault(tuple(x.shape), self.scale)
            y = x * 2
            x.add_(s)
            return y

    def run(scale: float) -> tuple[gg.GraphRunner, torch.Tensor, torch.Tensor]:
        m = Advance()
        r = make(m, state=[], canary=gg.Canary(every=1))
        m.scale = scale  # size 4's graph keeps 1.0
        x = x_(3)
        with torch.no_grad():
            y = r(x)
        return r, x, y

    r, x, y = run(1.0)  # nothing changed since capture: no divergence
    assert r.canary_stats()[4].divergences == 0
    torch.testing.assert_close(x, x_(3) + 1.0)
    r, x, y = run(3.0)
    torch.testing.assert_close(y, x_(3) * 2)  # the outputs agree
    torch.testing.assert_close(x, x_(3) + 1.0)  # the graph's write, as a plain call leaves
    st = r.canary_stats()[4]
    assert (st.checks, st.divergences) == (1, 1) and st.max_abs == pytest.approx(2.0)
    row = st.last.sizes[0]
    assert row.max_rel == 0.0  # the outputs compared equal: the input's difference alone
    assert row.note == "input input[0] after the call differs from eager's", row.note


# -------------------------------------------------------------------- the refusal


def test_undeclared_state_writes_refuse_the_canary_at_capture_and_every_call():
    m = Acc()
    r = gg.GraphRunner(
        m,
        (torch.randn(8, 4),),
        sizes=SIZES,
        backend=gg.RecordingBackend(),
        progress=False,
        canary=gg.Canary(every=1),
    )
    with pytest.raises(ConfigError, match=r"canary refused.*acc") as info, torch.no_grad():
        r.capture()
    assert "state=" in str(info.value)
    with pytest.raises(ConfigError, match="canary refused"), torch.no_grad():
        r(x_(4))


def test_unwatched_steps_without_declared_state_are_refused_and_state_list_accepted():
    with pytest.raises(ConfigError, match="cannot see whether"):
        make(Leaky(), canary=gg.Canary(), options=gg.CaptureOptions(warmup_iters=0))
    make(Leaky(), canary=gg.Canary(), state=[], options=gg.CaptureOptions(warmup_iters=0))
    r = make(Leaky(), canary=gg.Canary(every=1))  # watched, writes nothing: fine
    with torch.no_grad():
        r(x_(4))
    assert r.canary_stats()[4].checks == 1


# ------------------------------------------------------------------ other runners


def test_distributed_runner_passes_the_canary_through():
    import inspect

    assert "canary" in inspect.signature(gg.DistributedGraphRunner).parameters
    assert "canary" in inspect.signature(gg.PiecewiseRunner).parameters


# ------------------------------------------------------------------- verify, twice


def test_verify_checks_each_size_with_two_input_sets_so_a_frozen_length_shows():
    """A Python int (the batch length) frozen per shape on the first call: verify's
    first set (the full size) agrees; the second (one row shorter) does not."""

    class Length(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._len: dict[int, int] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self._len.setdefault(x.shape[0], x.shape[0])

    r = make(Length(), state=[])
    with pytest.raises(DivergenceError) as info, torch.no_grad():
        r.verify()
    failing = [c for c in info.value.report.sizes if not c.ok]
    assert failing and all(c.batch == c.graph - 1 for c in failing)


def test_a_recapture_gives_a_size_served_eagerly_its_graph_back():
    r, m = _diverging("eager")
    with torch.no_grad():
        r(x_(3))
        assert r.canary_stats()[4].eager
        m._frozen.clear()  # the fix: the cache is rebuilt by the new capture
        m.scale = 3.0
        r.recapture(reason="test: fixed")
        replays = r.backend.names().count("replay")
        r(x_(3))
    assert r.backend.names().count("replay") > replays
    st = r.canary_stats()[4]
    assert not st.eager and st.divergences == 1  # the count survives, the demotion not


def test_piecewise_runner_canary_checks_every_call_with_no_false_positive_poisoned_too():
    """Rows independent: NaN in the padded scale rows must not reach a real row."""
    from tests.test_piecewise import Tiny, batch

    torch._dynamo.reset()
    try:
        r = gg.PiecewiseRunner(
            Tiny(),
            batch(4),
            split_ops=[torch.ops.gg_test.attn],
            sizes=[1, 2, 4, 8],
            fill_values=(0, 1.0),
            backend=gg.RecordingBackend(),
            progress=False,
            state=[],
            canary=gg.Canary(every=1, on_divergence="raise", poison_padding=["input[1]"]),
        )
        with torch.no_grad():
            r.capture()
            for i in range(12):
                r(*batch(1 + i % 8, seed=i))
        assert sum(s.checks for s in r.canary_stats().values()) == 12
        assert sum(s.divergences for s in r.canary_stats().values()) == 0
    finally:
        torch._dynamo.reset()


def test_the_dispatcher_passes_the_canary_to_its_runner_through_options():
    from graphguard.dispatch import BatchKey

    m = ShapeCache()
    d = gg.build_dispatcher(
        m,
        (torch.zeros(1, 4),),
        mode="full",
        max_tokens=8,
        backend_factory=gg.RecordingBackend,
        options=gg.CaptureOptions(
            state=[], progress=False, canary=gg.Canary(every=1, on_divergence="raise")
        ),
    )
    with torch.no_grad():
        d.capture()
        m.scale = 2.0
        n = 3
        size = d.full.padded_size(n)
        assert size is not None and size > n  # padded: eager's shape is first seen now
        with pytest.raises(DivergenceError, match=f"size {size}"):
            d(BatchKey(num_tokens=n, num_reqs=n, uniform=True, query_len=1), x_(n))
    assert d.full.canary_stats()[size].divergences == 1


def test_graphed_causal_lm_passes_the_canary_to_its_decode_runner():
    """``GraphedCausalLM(canary=...)``: the decode runner checks every call (every=1) and
    finds no divergence on a correct model; generate still equals HF's eager generate."""
    pytest.importorskip("transformers")
    import torch as _torch

    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama", seed=0)
    g = GraphedCausalLM(
        model,
        max_batch=4,
        max_cache_len=64,
        backend=gg.RecordingBackend(),
        progress=False,
        canary=gg.Canary(every=1, on_divergence="raise"),
    )
    g.capture()
    ids, mask = F.prompts(2, seed=5)
    out = g.generate(ids, mask, max_new_tokens=4)
    with _torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
        )
    assert _torch.equal(out, ref)
    stats = g.runner.canary_stats()
    # The first new token comes from the eager prefill; the other 3 are decode replays.
    assert sum(s.checks for s in stats.values()) == 3
    assert all(s.divergences == 0 for s in stats.values())
