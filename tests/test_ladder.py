"""The ladder both runners share, the options object, and the runner-level bad inputs (CPU)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from importlib import import_module

import pytest
import torch

import graphguard as gg
from graphguard import capture as lifecycle
from graphguard.backend import RecordingBackend
from graphguard.config import CaptureOptions, Mode
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError
from graphguard.piecewise import PiecewiseRunner
from graphguard.state import StateSet
from tests.test_piecewise import SIZES, Tiny, batch
from tests.test_piecewise import make as make_piecewise

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x @ W + idx[:, None].to(x.dtype)


def full(fn=step, **kw):
    kw.setdefault("sizes", (1, 2, 4, 8))
    kw.setdefault("fill_values", (0.0, 5))
    kw.setdefault("progress", False)
    kw.setdefault("backend", RecordingBackend())
    return gg.GraphRunner(fn, (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)), **kw)


def inputs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- options


def test_graphguard_exports_the_runners_dispatch_options_and_verify():
    homes = {
        "PiecewiseRunner": "graphguard.piecewise",
        "Dispatcher": "graphguard.dispatch",
        "BatchKey": "graphguard.dispatch",
        "CaptureOptions": "graphguard.config",
        "StateSet": "graphguard.state",
        "CompiledStep": "graphguard.compiled",
        "verify": "graphguard.verify",
        "DistributedGraphRunner": "graphguard.distributed",
    }
    for name, home in homes.items():
        # The top-level name is its home's object (the class or function), not a module.
        assert name in gg.__all__ and getattr(gg, name) is getattr(import_module(home), name)
        assert callable(getattr(gg, name)), name
    assert gg.PiecewiseRunner is PiecewiseRunner


def test_names_that_left_the_top_level_in_0_2_are_gone_in_0_3():
    """The 0.1 aliases (served with a DeprecationWarning in 0.2) are removed: only their
    homes serve them."""
    for name, home in (("ConfigError", "errors"), ("CudaBackend", "backend"), ("Phase", "phase")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(gg, name)
        assert callable(getattr(importlib.import_module(f"graphguard.{home}"), name))
    assert gg.errors.ConfigError is ConfigError
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        gg.NoSuchThing  # noqa: B018
    assert "ConfigError" not in gg.__all__ and len(gg.__all__) <= 25
    assert "Lazy" in gg.__all__ and gg.Lazy is gg.config.Lazy


def test_one_name_per_option_across_runners_and_capture_plan():
    opt_names = {f.name for f in dataclasses.fields(CaptureOptions)}
    plan_names = {f.name for f in dataclasses.fields(lifecycle.CapturePlan)}
    shared = {
        "warmup_iters",
        "before_capture",
        "after_capture",
        "workspaces",
        "capture_error_mode",
        "on_capture_error",
        "progress",
        "name",
        "state",
    }
    assert shared <= opt_names and shared <= plan_names
    assert not {"on_error", "error_mode", "owner"} & (opt_names | plan_names)
    # The runner kind is not an option: one options object serves every runner.
    assert not {"mode", "compile", "split_ops", "fullgraph"} & opt_names


def test_the_typed_keywords_are_the_keyword_options():
    """``CaptureKwargs`` (what mypy and IDEs check) lists exactly the keyword options,
    ``inspect.signature`` / ``help()`` show each as a keyword of every runner, and the
    options-only fields are no runner's keyword."""
    import inspect

    from graphguard.config import KEYWORD_OPTIONS, OPTIONS_ONLY, CaptureKwargs

    assert set(CaptureKwargs.__annotations__) == set(KEYWORD_OPTIONS)
    for cls in (gg.GraphRunner, gg.PiecewiseRunner, gg.DistributedGraphRunner):
        params = inspect.signature(cls).parameters
        assert set(KEYWORD_OPTIONS) <= set(params), cls
        assert not set(OPTIONS_ONLY) & set(params), cls
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), cls
        assert params["sizes"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize(
    "name", ["max_size", "warmup_iters", "on_capture_error", "generators", "weights"]
)
def test_an_options_only_keyword_says_where_it_moved(name):
    """The options a runner no longer takes as keywords (0.4) are named in the error, with
    the spelling that works."""
    with pytest.raises(
        ConfigError,
        match=rf"{name} moved into options=graphguard\.CaptureOptions\({name}=\.\.\.\) in 0\.4",
    ):
        full(**{name: None})


def test_a_runners_face_is_small_enough_to_hold():
    """At most 40 public members and 20 parameters (issue 37): the serving features'
    operations are on ``runner.door``, the rarely set options on ``options=``."""
    import inspect

    r = full()
    public = [n for n in dir(r) if not n.startswith("_")]
    assert len(public) <= 40, public
    for cls in (gg.GraphRunner, gg.PiecewiseRunner):
        assert len(inspect.signature(cls).parameters) <= 20, cls


def test_one_options_object_serves_both_runners():
    opts = CaptureOptions(sizes=[1, 2], fill_values=(0.0, 5), progress=False, name="shared")
    ex = (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    a = gg.GraphRunner(step, ex, options=opts, backend=RecordingBackend())
    b = gg.PiecewiseRunner(step, ex, split_ops=[], options=opts, backend=RecordingBackend())
    assert a.mode is Mode.FULL and b.mode is Mode.PIECEWISE
    for r in (a, b):
        assert r.sizes == (1, 2) and r.options.progress is False and r.name == "shared"
        assert r.options.fill_values == (0.0, 5)


def test_options_pass_through_build_dispatcher_to_both_runners():
    hook_calls: list[list[int]] = []
    opts = CaptureOptions(
        fill_values=(0.0, 5),
        progress=False,
        warmup_iters=2,
        capture_error_mode="relaxed",
        before_capture=[lambda sizes: hook_calls.append(list(sizes))],
        name="dec",
    )
    d = gg.build_dispatcher(
        step,
        (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)),
        mode="full_and_piecewise",
        split_ops=["aten::softmax"],
        max_tokens=8,
        backend_factory=RecordingBackend,
        options=dataclasses.replace(opts, copy_outputs=True),
    )
    assert d.full is not None and d.piecewise is not None
    for r, suffix in ((d.full, "full"), (d.piecewise, "piecewise")):
        o = r.options
        assert (o.warmup_iters, o.capture_error_mode, o.progress, o.copy_outputs) == (
            2,
            "relaxed",
            False,
            True,
        )
        assert o.fill_values == (0.0, 5) and r.name == f"dec.{suffix}"
        assert o.before_capture == opts.before_capture
    with pytest.raises(ConfigError, match="build_dispatcher does not take sizes="):
        gg.build_dispatcher(step, (torch.zeros(3, 6),), mode="full", max_tokens=8, sizes=[1])
    with pytest.raises(ConfigError, match=r"build_dispatcher: unknown argument.*'warmup_iter'"):
        gg.build_dispatcher(step, (torch.zeros(3, 6),), mode="full", max_tokens=8, warmup_iter=1)


def test_a_field_left_none_takes_the_runner_default_and_set_fields_stay():
    opts = CaptureOptions(capture_error_mode="global", progress=False, name="mystep")
    assert opts.warmup_iters is None  # what the caller set, nothing more
    r = full(options=opts)
    assert (r.options.capture_error_mode, r.options.progress, r.name) == ("global", False, "mystep")
    assert r.options.warmup_iters == 1 and r.options.fill_values == (0.0, 5)
    assert full(fill_values=None).options.fill_values == 0  # None: the default


def test_resolved_fills_only_unset_fields():
    opts = CaptureOptions(progress=False)
    done = opts.resolved(capture_error_mode="thread_local", progress=True)
    assert done.progress is False and done.capture_error_mode == "thread_local"
    assert done.on_capture_error == "raise" and opts.capture_error_mode is None


def test_sizes_and_max_size_together_are_refused():
    with pytest.raises(ConfigError, match=r"sizes=\[1, 2\] and max_size=64 were both given"):
        CaptureOptions(sizes=[1, 2], max_size=64)
    with pytest.raises(ConfigError, match="both given"):
        full(
            options=CaptureOptions(sizes=[1, 2], max_size=64),
        )


def test_misspelt_options_field_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"CaptureOptions: unknown argument\(s\) 'sizess' "):
        CaptureOptions(sizess=[1, 2])  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"did you mean 'compile'"):
        full(compiel=True)


@pytest.mark.parametrize("flag", ["copy_outputs", "progress"])
@pytest.mark.parametrize("value", ["false", 0, 1, "True"])
def test_string_and_int_flags_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be True or False"):
        CaptureOptions(**{flag: value})


@pytest.mark.parametrize("flag", ["share_outputs", "sanitize"])
@pytest.mark.parametrize("value", ["false", 0, 1, "True"])
def test_string_and_int_runner_flags_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be True or False"):
        full(**{flag: value})


def test_runner_passes_its_options_to_the_capture_plan_under_the_same_names(monkeypatch):
    seen: list[lifecycle.CapturePlan] = []
    real = lifecycle.run

    def spy(plan, backend, **kw):
        seen.append(plan)
        return real(plan, backend, **kw)

    monkeypatch.setattr(lifecycle, "run", spy)
    state = StateSet({"cache": torch.zeros(2)})
    r = full(
        state=state,
        name="dec",
        options=gg.CaptureOptions(capture_error_mode="relaxed", warmup_iters=2),
    )
    r.capture()
    (plan,) = seen
    assert (plan.capture_error_mode, plan.on_capture_error, plan.warmup_iters) == (
        "relaxed",
        "raise",
        2,
    )
    assert plan.mode is Mode.FULL and plan.state is state and plan.name == "GraphRunner(dec)"
    assert r.state is state and r.options.state is state


def test_options_object_is_shared_and_keywords_override_it():
    base = CaptureOptions(sizes=[1, 2, 4], fill_values=(0.0, 5), progress=False, warmup_iters=2)
    a = gg.GraphRunner(
        step,
        (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)),
        options=base,
        backend=RecordingBackend(),
        name="a",
    )
    assert a.sizes == (1, 2, 4) and a.options.warmup_iters == 2 and a.name == "a"
    assert base.name is None  # the shared object is not modified
    a.capture()
    torch.testing.assert_close(a(*inputs(3)), step(*inputs(3)))


def test_unknown_runner_argument_names_the_closest_option():
    with pytest.raises(ConfigError, match="'sizez' \\(did you mean 'sizes'\\?\\)"):
        full(sizez=[2])
    with pytest.raises(ConfigError, match="'fill_value' \\(did you mean 'fill_values'\\?\\)"):
        full(fill_value=0)
    with pytest.raises(ConfigError, match="'warmup_iter' \\(did you mean 'warmup_iters'\\?\\)"):
        CaptureOptions(warmup_iter=2)


def test_options_are_validated_once_at_construction():
    with pytest.raises(ConfigError, match="on_capture_error"):
        CaptureOptions(on_capture_error="ignore")
    with pytest.raises(ConfigError, match="capture_error_mode"):
        CaptureOptions(capture_error_mode="strict")
    with pytest.raises(ConfigError, match=r"options must be a graphguard\.CaptureOptions"):
        full(options={"sizes": [1]})


@pytest.mark.parametrize("make", ["full", "piecewise"])
def test_mode_none_is_an_error_not_eager(make):
    with pytest.raises(ConfigError, match=r"mode must be a graphguard\.Mode or its name, got None"):
        if make == "full":
            full(mode=None)
        else:
            make_piecewise(mode=None)


def test_mode_is_one_spelling_a_str_enum():
    assert Mode.NONE == "none" and f"{Mode.FULL}" == "full" and {"full": 1}[Mode.FULL] == 1
    plan = gg.dispatch.DispatchPlan("full", max_tokens=8)
    assert plan.resolve(gg.BatchKey.mixed(5, 2)).kind is Mode.NONE


@torch.no_grad()
def test_split_op_that_never_runs_is_an_error_naming_it_and_the_ops_that_ran():
    r = PiecewiseRunner(
        Tiny(), batch(4), split_ops=["gg_test::atn"], sizes=SIZES, backend=RecordingBackend()
    )
    with pytest.raises(ConfigError, match=r"split op\(s\) gg_test::atn never ran.*gg_test::attn"):
        r.compile()


def test_piecewise_refuses_sanitize_and_full_mode():
    with pytest.raises(ConfigError, match="sanitize=True is not supported"):
        make_piecewise(sanitize=True)
    with pytest.raises(ConfigError, match="PiecewiseRunner runs mode 'piecewise' or 'none'"):
        make_piecewise(mode="full")


# --------------------------------------------------------------------------- replay(n)


@pytest.mark.parametrize("bad", [-1, -8, 0, 9, 100, 2.5, None, "4"])
def test_replay_and_static_inputs_refuse_a_bad_batch_size(bad):
    r = full()
    r.capture()
    with pytest.raises(GraphGuardError, match="batch"):
        r.replay(bad)
    with pytest.raises(GraphGuardError, match="batch"):
        r.static_inputs(bad)


def test_replay_minus_one_never_replays_the_largest_graph():
    be = RecordingBackend()
    r = full(backend=be)
    r.capture()
    be.events.clear()
    with pytest.raises(GraphGuardError, match="no graph for a batch of -1"):
        r.replay(-1)
    assert ("replay", 8) not in be.events


# --------------------------------------------------------------------------- outputs


@torch.no_grad()
def test_python_number_output_leaf_is_refused_at_capture_naming_the_leaf():
    def fn(x, idx):
        return step(x, idx), x.shape[0]

    r = full(fn)
    with pytest.raises(GraphCaptureError, match=r"leaf 1 = 8 \(int\).*Return a tensor"):
        r.capture()


@torch.no_grad()
def test_python_number_output_leaf_is_refused_without_warmups_too():
    def fn(x, idx):
        return {"y": step(x, idx), "scale": 0.5}

    r = full(fn, options=gg.CaptureOptions(warmup_iters=0))
    with pytest.raises(GraphCaptureError, match=r"leaf 1 = 0.5 \(float\)"):
        r.capture()


@torch.no_grad()
def test_non_batch_output_whose_first_dim_equals_a_capture_size_is_not_cut():
    table = torch.arange(8.0)  # 8 rows: the largest capture size, but not a batch

    def fn(x, idx):
        return step(x, idx), table * 2

    r = full(fn)
    r.capture()
    for n in (3, 8, 1):
        y, t = r(*inputs(n))
        torch.testing.assert_close(y, step(*inputs(n)))
        torch.testing.assert_close(t, table * 2)


@torch.no_grad()
def test_piecewise_non_batch_output_whose_first_dim_equals_a_capture_size_is_not_cut():
    class WithTable(Tiny):
        def forward(self, tokens, scale):
            x, s = super().forward(tokens, scale)
            return x, self.mem.sum(-1).repeat(4)[:16] + 0 * s.sum()

    model = WithTable()
    r, _ = make_piecewise(model)
    r.capture()
    for n in (3, 16, 1):
        x = batch(n)
        got = r(*x)
        want = model(*x)
        assert got[1].shape == (16,)
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- grad


def test_inputs_that_require_grad_replay_detached_and_never_break_the_runner(caplog):
    r = full()
    r.capture()
    x, idx = inputs(3)
    x.requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        out = r(x, idx)
        torch.testing.assert_close(out, step(x.detach(), idx))
        out = r(x, idx)
    assert not out.requires_grad
    assert not any(b.requires_grad for b in r.static.buffers)
    assert sum("require grad" in m.getMessage() for m in caplog.records) == 1
    for n in (2, 8, 3):  # later plain calls still replay correctly
        torch.testing.assert_close(r(*inputs(n, seed=n)), step(*inputs(n, seed=n)))


# --------------------------------------------------------------------------- piecewise


@torch.no_grad()
def test_piecewise_zero_copy_path_equals_eager_and_pads():
    r, model = make_piecewise()
    r.capture()
    for n in (3, 16, 1, 5):
        x = batch(n, seed=n)
        for view, src in zip(r.static_inputs(n), x):
            view.copy_(src)
        torch.testing.assert_close(r.replay(n), model(*x))
    with pytest.raises(GraphGuardError, match="no graph for a batch of 17"):
        r.static_inputs(17)


@torch.no_grad()
def test_piecewise_recapture_drops_and_recaptures_every_piece_without_recompiling():
    be = RecordingBackend()
    r, model = make_piecewise(backend=be)
    r.capture()
    with pytest.raises(GraphGuardError, match="recapture"):
        r.capture()
    with torch.no_grad():
        model.mem.mul_(0.5)  # a deliberate change, e.g. weights reloaded
    be.events.clear()
    report = r.recapture(reason="weights reloaded")
    assert r.captured_sizes == tuple(SIZES) and r.compile_count == 1
    assert [s.size for s in report.sizes] == sorted(SIZES, reverse=True)
    assert all(p.captured_sizes == tuple(SIZES) for p in r.pieces)
    x = batch(6)
    torch.testing.assert_close(r(*x), model(*x))


@torch.no_grad()
def test_piecewise_release_then_calls_fail_until_capture():
    r, _ = make_piecewise()
    r.capture()
    r.release()
    assert r.captured_sizes == () and all(p.captured_sizes == () for p in r.pieces)
    r._store.serving = True  # released graphs: calls do not replay a dropped size
    with pytest.raises(GraphGuardError, match="no graph for a batch of 4"):
        r.replay(4)


@torch.no_grad()
def test_piecewise_verify_compares_every_size_with_eager():
    r, _ = make_piecewise()
    r.capture()
    report = r.verify()
    assert [c.size for c in report.sizes] == SIZES and report.ok


def test_dispatcher_release_drops_both_runners():
    plan = gg.dispatch.DispatchPlan("full_and_piecewise", max_tokens=16, full_sizes=[1, 2, 4])
    r_full = full(sizes=plan.full_sizes)
    r_pw, _ = make_piecewise(sizes=list(plan.piecewise_sizes))
    d = gg.Dispatcher(plan, eager=step, full=r_full, piecewise=r_pw)
    with torch.no_grad():
        d.capture()
    assert r_full.captured_sizes and r_pw.captured_sizes
    d.release()
    assert r_full.captured_sizes == () and r_pw.captured_sizes == ()
