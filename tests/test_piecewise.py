"""PIECEWISE on the CPU: the split, one compile for every size, capture order, the tripwire.

Graphs are emulated by the RecordingBackend (replay re-runs the piece), so these tests
check the structure and the numerics of the split path, not CUDA itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.backend import RecordingBackend
from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan
from graphguard.errors import CaptureTripwireError, ConfigError, GraphGuardError
from graphguard.phase import Phase
from graphguard.piecewise import (
    PiecewiseCompiler,
    PiecewiseRunner,
    SplitMatcher,
    pieces,
    split_graph,
)

OP_CALLS: list[Phase] = []


@torch.library.custom_op("gg_test::attn", mutates_args=())
def attn(q: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    """Each row attends over a fixed memory: rows independent, so padding is harmless."""
    OP_CALLS.append(gg.phase.current_phase())
    return torch.softmax(q @ mem.t(), dim=-1) @ mem


@attn.register_fake
def _(q: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


class Tiny(torch.nn.Module):
    """Two layers, each: projection -> attention (the split op) -> projection, residual."""

    def __init__(self, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(50, d, generator=g))
        self.mem = torch.nn.Parameter(torch.randn(5, d, generator=g))
        self.q = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(d, d, generator=g) * d**-0.5) for _ in range(layers)]
        )
        self.o = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(d, d, generator=g) * d**-0.5) for _ in range(layers)]
        )

    def forward(
        self, tokens: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed[tokens] * scale[:, None]
        for q, o in zip(self.q, self.o):
            a = torch.ops.gg_test.attn(torch.tanh(x @ q), self.mem)
            x = x + (a @ o).view(tokens.shape[0], 2, -1).reshape(tokens.shape[0], -1)
        return x, x.sum(-1)


SIZES = [1, 2, 4, 8, 16]


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g) + 0.5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    OP_CALLS.clear()
    yield
    torch._dynamo.reset()


def make(model=None, **kw):
    model = model or Tiny()
    kw.setdefault("sizes", SIZES)
    kw.setdefault("backend", RecordingBackend())
    kw.setdefault("fill_values", (0, 1.0))
    r = PiecewiseRunner(
        model, batch(4), split_ops=[torch.ops.gg_test.attn], progress=False, name="tiny", **kw
    )
    return r, model


# ----------------------------------------------------------------------------- split


@pytest.mark.compile
def test_split_gives_one_piece_more_than_split_ops_with_split_ops_alone():
    model = Tiny(layers=3)
    compiler = PiecewiseCompiler([torch.ops.gg_test.attn])
    compiled = torch.compile(model, backend=compiler, dynamic=True)
    x = batch(6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x))
    assert compiler.compile_count == 1
    split_nodes = [n for n in compiler.graphs[0].graph.nodes if compiler.matcher(n)]
    assert len(split_nodes) == 3
    assert len(compiler.pieces) == 4
    sg = compiler.splits[0]
    assert len(sg.split_ops) == 3
    for name in sg.split_ops:
        inner = sg.module.get_submodule(name).module
        calls = [n for n in inner.graph.nodes if n.op == "call_function"]
        assert [compiler.matcher(n) for n in calls] == [True]
    for piece in compiler.pieces:
        assert not any(compiler.matcher(n) for n in piece.module.graph.nodes)


def test_pieces_fed_by_a_split_op_copy_that_input_and_the_first_piece_copies_nothing():
    r, _ = make()
    r.compile()
    assert r.pieces[0].copied_inputs == ()
    assert all(len(p.copied_inputs) == 1 for p in r.pieces[1:])


def test_graph_without_split_ops_is_one_piece():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    sg = split_graph(gm, SplitMatcher([torch.ops.gg_test.attn]))
    assert (len(sg.pieces), sg.split_ops) == (1, [])


@pytest.mark.compile
@pytest.mark.parametrize(
    "spec", ["gg_test::attn", torch.ops.gg_test.attn, torch.ops.gg_test.attn.default]
)
def test_split_op_may_be_named_by_string_packet_or_overload(spec):
    compiler = PiecewiseCompiler([spec])
    torch.compile(Tiny(), backend=compiler, dynamic=True)(*batch(3))
    assert len(compiler.pieces) == 3


def test_bad_split_op_name_is_a_config_error():
    with pytest.raises(ConfigError, match="namespace::op"):
        SplitMatcher(["attn"])


# ---------------------------------------------------------------- compile and replay


@torch.no_grad()
def test_replay_equals_eager_across_sizes_with_a_single_compile():
    r, model = make()
    report = r.capture()
    assert report.captured == SIZES
    assert r.compile_count == 1
    for n in [1, 3, 5, 8, 11, 16, 2, 20, 7, 1]:
        x = batch(n, seed=n)
        out = r(*x)
        ref = model(*x)
        assert out[0].shape == (n, 8)
        assert out[1].shape == (n,)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert r.compile_count == 1, "a token count recompiled the graph"


@torch.no_grad()
def test_capture_is_largest_first_every_piece_per_size_after_a_synchronize():
    be = RecordingBackend()
    r, _ = make(backend=be)
    r.capture()
    begins = [e[1] for e in be.events if e[0] == "capture_begin"]
    assert begins == [(s, i) for s in sorted(SIZES, reverse=True) for i in range(3)]
    for s in SIZES:
        first = be.events.index(("capture_begin", (s, 0)))
        assert be.events[first - 1] == ("synchronize",)


@torch.no_grad()
def test_a_padded_call_replays_every_piece_of_the_padded_size_and_runs_split_ops_eagerly():
    be = RecordingBackend()
    r, _ = make(backend=be)
    r.capture()
    be.events.clear()
    OP_CALLS.clear()
    r(*batch(5))
    assert be.events == [("replay", (8, 0)), ("replay", (8, 1)), ("replay", (8, 2))]
    assert OP_CALLS == [Phase.SERVING, Phase.SERVING]


@torch.no_grad()
def test_split_ops_run_in_warmup_phase_while_pieces_capture():
    r, _ = make(sizes=[4])
    r.capture()
    # compile hook + warmup forward + the capture forward: the split op is eager in all.
    assert OP_CALLS
    assert set(OP_CALLS) == {Phase.WARMUP}


@torch.no_grad()
def test_size_above_the_largest_runs_eagerly_without_recompiling_and_is_logged_once(caplog):
    be = RecordingBackend()
    r, model = make(backend=be)
    r.capture()
    be.events.clear()
    with caplog.at_level(logging.INFO, logger="graphguard"):
        for _ in range(3):
            x = batch(23)
            torch.testing.assert_close(r(*x), model(*x))
    assert be.events == []
    assert sum("batch size 23 runs eagerly" in m.getMessage() for m in caplog.records) == 1
    assert r.compile_count == 1


@torch.no_grad()
def test_failed_capture_drops_that_size_from_every_piece():
    be = RecordingBackend()
    be.fail_on = {(4, 1)}
    r, model = make(backend=be, options=gg.CaptureOptions(on_capture_error="skip"))
    report = r.capture()
    assert report.failed == [4]
    assert r.captured_sizes == (1, 2, 8, 16)
    assert all(4 not in p.captured_sizes for p in r.pieces)
    assert r.padded_size(3) == 8
    x = batch(3)
    torch.testing.assert_close(r(*x), model(*x))


@torch.no_grad()
def test_outputs_are_owned_clones_with_copy_outputs():
    r, _ = make(options=gg.CaptureOptions(copy_outputs=True))
    r.capture()
    first = r(*batch(4, seed=1))[0]
    kept = first.clone()
    r(*batch(4, seed=2))
    assert torch.equal(first, kept)


def test_piecewise_capture_forwards_end_captures_to_the_real_backend():
    class Counting(RecordingBackend):
        ends = 0

        def end_captures(self) -> None:
            self.ends += 1

    be = Counting()
    r, model = make(backend=be, sizes=[2, 4])
    r.capture()
    assert be.ends == 1
    x = batch(3)
    torch.testing.assert_close(r(*x), model(*x))


def test_call_before_capture_is_an_error():
    r, _ = make()
    with pytest.raises(GraphGuardError, match="before capture"):
        r(*batch(2))


def test_mode_none_runs_fn_without_compiling():
    r, model = make(mode="none")
    r.capture()
    x = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(r(*x), model(*x))
    assert r.compile_count == 0


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_full_modes_are_rejected_with_the_way_to_get_them(mode):
    with pytest.raises(ConfigError, match="GraphRunner"):
        make(mode=mode)


# -------------------------------------------------------------------------- safety


def test_piece_capture_outside_the_window_trips_the_wire():
    r, _ = make()
    r.compile()
    with pytest.raises(CaptureTripwireError, match=r"piecewise piece 1 \(size 8\)"):
        r.pieces[1].capture_at(8, ())


@torch.no_grad()
def test_capture_state_leaking_into_serving_trips_the_wire_not_a_silent_capture():
    r, _ = make()
    r.capture()
    r.session.state = pieces.CAPTURE
    r.session.size = 8
    try:
        with pytest.raises(CaptureTripwireError, match="piecewise piece 0"):
            r.compile()(*batch(8))
    finally:
        r.session.state = pieces.EAGER


@torch.no_grad()
def test_replay_refuses_inputs_that_moved_since_capture():
    r, _ = make()
    r.capture()
    r.session.state, r.session.size = pieces.REPLAY, 8
    try:
        with pytest.raises(GraphGuardError, match="moved since capture"):
            r.compile()(*batch(8))  # fresh tensors, not the runner's static buffers
    finally:
        r.session.state = pieces.EAGER


@torch.no_grad()
def test_capture_window_allows_a_piece_capture():
    r, _ = make()
    r.compile()
    r.session.backend = RecordingBackend()
    args = _piece0_args(r)
    with phase.capture_window("test"):
        out = r.pieces[0].capture_at(8, args)
    assert r.pieces[0].captured_sizes == (8,)
    assert r.compile_count == 1
    assert isinstance(out, (torch.Tensor, tuple))


def test_serving_under_another_grad_mode_recompiles_and_warns(caplog):
    r, model = make()
    with torch.no_grad():
        r.capture()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        x = batch(4)
        torch.testing.assert_close(r(*x), model(*x))
    assert r.compile_count == 2
    warned = [m.getMessage() for m in caplog.records if "recompiled" in m.getMessage()]
    assert len(warned) == 1, warned
    assert "grad" in warned[0] and "same torch.no_grad()" in warned[0]
    assert r.recompile_reasons and "2 compiles" in r.describe()


def _piece0_args(r: PiecewiseRunner) -> list[object]:
    """The arguments the parent graph passes to its first piece, recorded from a forward."""
    seen: list[object] = []
    piece = r.pieces[0]
    hook = piece.register_forward_pre_hook(lambda mod, args: seen.extend(args))
    try:
        r.compile()(*r.static.views(8))
    finally:
        hook.remove()
    return seen


# ------------------------------------------------------------------- with a dispatcher


@torch.no_grad()
def test_full_and_piecewise_through_a_dispatcher_equals_eager():
    model = Tiny()
    full = gg.GraphRunner(
        model,
        batch(4),
        sizes=[1, 2, 4],
        fill_values=(0, 1.0),
        backend=RecordingBackend(),
        progress=False,
    )
    pw, _ = make(model, sizes=[1, 2, 4, 8, 16])
    plan = DispatchPlan(
        "full_and_piecewise", max_tokens=32, full_sizes=[1, 2, 4], piecewise_sizes=[1, 2, 4, 8, 16]
    )
    d = Dispatcher(plan, eager=model, full=full, piecewise=pw)
    d.capture()
    kinds = set()
    for n, uniform in [(3, True), (3, False), (6, True), (12, False), (20, False), (1, True)]:
        key = BatchKey.decode(n) if uniform else BatchKey.mixed(n, 1)
        kinds.add(d.plan.resolve(key).kind)
        x = batch(n, seed=n)
        torch.testing.assert_close(d(key, *x), model(*x), rtol=1e-5, atol=1e-5)
    assert kinds == {"full", "piecewise", "none"}
