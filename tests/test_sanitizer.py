"""The sanitizer on the CPU, through the RecordingBackend (its capture runs the body eagerly,
so the dispatch modes see real ops)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import graphguard as gg
from graphguard import sanitizer, streams
from graphguard.backend import RecordingBackend
from graphguard.errors import (
    BusyStreamError,
    CaptureUnsafeOpError,
    ConfigError,
    DivergenceError,
    FreedStorageError,
    StaleOutputError,
)
from graphguard.runner import GraphRunner
from graphguard.sanitizer import Sanitizer, VerifyReport, stale, verify

SIZES = (1, 2, 4, 8)


def make(fn, *, sanitize=True, sizes=SIZES, **kw):
    kw.setdefault("fill_values", (0.0, 5))
    return gg.GraphRunner(
        fn,
        (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)),
        sizes=sizes,
        backend=RecordingBackend(),
        progress=False,
        sanitize=sanitize,
        **kw,
    )


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


def closure_model():
    state = {"w": torch.randn(6, 6, generator=torch.Generator().manual_seed(0))}

    def fn(x, idx):
        return x @ state["w"] + idx[:, None].to(x.dtype)

    return fn, state


# --------------------------------------------------------------------------- the switch


def test_flag_builds_the_runner_with_a_sanitizer_part(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    fn, _ = closure_model()
    r = make(fn, sanitize=True)
    assert type(r) is GraphRunner and isinstance(r._sanitizer, Sanitizer)
    assert r.sanitize is True
    plain = make(fn, sanitize=None)
    assert type(plain) is GraphRunner and plain._sanitizer is None
    assert plain.sanitize is False
    with pytest.raises(
        ConfigError,
        match=r"sanitize left the options in 0\.3.*GraphRunner\(\.\.\., sanitize=True\)",
    ):
        gg.CaptureOptions(sanitize=True)


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_env_var_turns_it_on(monkeypatch, value):
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", value)
    fn, _ = closure_model()
    r = make(fn, sanitize=None)
    assert type(r) is GraphRunner and r._sanitizer is not None
    assert r.sanitize is True


@pytest.mark.parametrize("value", ["0", "false", "Off", "no", ""])
def test_env_var_off_values(monkeypatch, value):
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", value)
    fn, _ = closure_model()
    assert make(fn, sanitize=None)._sanitizer is None


@pytest.mark.parametrize("value", ["2", "enable", "flase"])
def test_env_var_typo_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", value)
    fn, _ = closure_model()
    with pytest.raises(ConfigError, match=rf"GRAPHGUARD_SANITIZE='{value}' is neither on"):
        make(fn, sanitize=None)


@pytest.mark.parametrize("value", ["false", "0", "no", 1, 0])
def test_a_string_or_int_flag_is_refused(monkeypatch, value):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    fn, _ = closure_model()
    with pytest.raises(ConfigError, match="sanitize must be True or False"):
        make(fn, sanitize=value)


def test_the_flag_wins_over_the_env_var(monkeypatch):
    fn, _ = closure_model()
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", "1")
    assert make(fn, sanitize=False)._sanitizer is None
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", "0")
    assert make(fn, sanitize=True)._sanitizer is not None


def test_a_subclass_is_sanitized_too(monkeypatch):
    """A user's subclass with sanitize=True gets the checks (its own overrides below them),
    with or without a shared options object beside the keyword, and stays its own class."""
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    fn, _ = closure_model()
    calls = []

    class Mine(GraphRunner):
        def _run(self, e):
            calls.append(e.n)
            return super()._run(e)

    ex = (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    for kw in ({}, {"options": gg.CaptureOptions(progress=False)}):
        r = Mine(
            fn, ex, sizes=[1, 2], fill_values=(0.0, 5), backend=RecordingBackend(),
            sanitize=True, **kw,
        )  # fmt: skip
        assert type(r) is Mine and r._sanitizer is not None
    r.capture()
    x, idx = torch.ones(2, 6), torch.zeros(2, dtype=torch.long)
    out = r(x, idx)
    assert calls == [2]  # Mine._run ran, under the checks
    torch.testing.assert_close(out, fn(x, idx))
    r(x, idx)  # the next call overwrites out's memory: the checks make reading it raise
    with pytest.raises((StaleOutputError, RuntimeError), match="call #1"):
        _ = out + 1


def test_off_the_replay_path_is_exactly_the_fast_path(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    fn, _ = closure_model()
    r = make(fn, sanitize=False)
    assert type(r).__call__ is GraphRunner.__call__
    assert type(r)._forward is GraphRunner._forward
    r.capture()
    x = batch(3)
    out = r(*x)
    assert type(out) is torch.Tensor  # a plain view, no guard


def test_capabilities_say_what_degrades():
    caps = sanitizer.capabilities()
    assert set(caps) == {"stale_outputs", "freed_storage", "sync_debug"}
    assert all(isinstance(v, str) and v for v in caps.values())


# --------------------------------------------------------------------------- storage bookkeeping


def test_capture_records_external_storages_with_names_and_sites():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    for size in SIZES:
        watched = {t.name: t for t in r.watched_storages(size)}
        assert "state['w']" in watched, watched
        assert "static input 'input[0]'" in watched
        assert "static input 'input[1]'" in watched
        assert "static output leaf 0" in watched
        w = watched["state['w']"]
        assert w.data_ptr == state["w"].data_ptr()
        assert w.nbytes == 6 * 6 * 4
        assert "float32 [6, 6]" in w.tensor
        assert w.op == "aten.mm"
        assert "test_sanitizer.py" in w.site
        assert w.problem() is None


def test_intermediates_made_inside_the_capture_are_not_watched():
    w = torch.randn(6, 6)

    def fn(x, idx):
        tmp = x @ w  # produced inside the capture: graph pool memory
        return torch.relu(tmp) + idx[:, None].to(x.dtype)

    r = make(fn)
    r.capture()
    ptrs = {t.data_ptr for t in r.watched_storages(4)}
    assert w.untyped_storage().data_ptr() in ptrs
    assert len(ptrs) == 4  # x, idx, w, the static output


def test_module_parameters_and_buffers_are_named():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.register_buffer("shift", torch.ones(6))

        def forward(self, x, idx):
            return self.lin(x) + self.shift + idx[:, None].to(x.dtype)

    m = M()
    with torch.no_grad():
        r = make(m)
        r.capture()
    names = {t.name for t in r.watched_storages(2)}
    assert {"parameter M.lin.weight", "parameter M.lin.bias", "buffer M.shift"} <= names


def test_workspace_arenas_are_named():
    arena = gg.Workspace("scratch", "cpu")

    def fn(x, idx):
        (buf,) = arena.get((x.shape, x.dtype))
        torch.mul(x, 2.0, out=buf)
        return buf + idx[:, None].to(x.dtype)

    r = make(fn, workspaces=[arena])
    r.capture()
    assert "workspace arena 'scratch'" in {t.name for t in r.watched_storages(8)}
    for _ in range(3):
        r(*batch(5))  # locked arena, no growth: no false positive


def test_a_failed_size_keeps_no_records():
    fn, _ = closure_model()
    r = make(fn, options=gg.CaptureOptions(on_capture_error="skip"))
    r.backend.fail_on.add(2)
    r.capture()
    assert r.watched_storages(2) == []
    assert r.watched_storages(4)


# --------------------------------------------------------------------------- freed / moved


def test_freed_storage_is_caught_before_replay():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    r(*batch(3))
    state["w"] = torch.randn(6, 6)  # the captured tensor is freed (seed 002's arena growth)
    with pytest.raises(FreedStorageError) as info:
        r(*batch(3))
    msg = str(info.value)
    print(msg)
    assert "size-4 graph" in msg
    assert "state['w']" in msg
    assert "float32 [6, 6] (144 bytes)" in msg
    assert "freed" in msg
    assert "recapture" in msg


def test_arena_that_reallocates_after_capture_is_caught_in_general():
    class Arena:
        """Not a graphguard Workspace: grows by replacing its buffer, as engines do."""

        def __init__(self):
            self.buf = torch.empty(64)

        def get(self, n):
            if n > self.buf.numel():
                self.buf = torch.empty(2 * n)
            return self.buf[:n]

    arena = Arena()

    def fn(x, idx):
        tmp = arena.get(x.numel()).view_as(x)
        torch.mul(x, 2.0, out=tmp)
        return tmp + idx[:, None].to(x.dtype)

    r = make(fn)
    r.capture()
    r(*batch(8))
    arena.get(1000)  # growth after capture frees the captured buffer
    with pytest.raises(FreedStorageError, match=r"arena\.buf"):
        r(*batch(8))


def test_resized_storage_is_caught():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    state["w"].untyped_storage().resize_(0)  # FSDP-style free, storage object kept
    with pytest.raises(FreedStorageError, match="resized from 144 to 0 bytes"):
        r(*batch(2))


def test_moved_storage_is_caught():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    st = state["w"].untyped_storage()
    st.resize_(st.nbytes() * 64)  # reallocates: same storage object, new address
    with pytest.raises(FreedStorageError, match="resized from 144 to 9216 bytes"):
        r(*batch(2))


def test_check_storages_on_demand_checks_every_size():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    r.check_storages()
    state.clear()
    with pytest.raises(FreedStorageError, match="size-1 graph"):
        r.check_storages()


# --------------------------------------------------------------------------- stale outputs


def test_outputs_read_after_the_next_call_raise():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    first = r(*batch(3, seed=1))
    view = first[1:]
    torch.testing.assert_close(first, fn(*batch(3, seed=1)))
    assert first.shape == (3, 6)
    second = r(*batch(2, seed=2))
    for old in (first, view):
        with pytest.raises((StaleOutputError, RuntimeError)) as info:
            _ = old + 1
        msg = str(info.value)
        print(msg)
        assert "call #1 (batch 3, replaying the size-4 graph)" in msg
        assert "call #2 (batch 2, replaying the size-2 graph)" in msg
        assert "clone" in msg
    assert first.shape == (3, 6)  # metadata stays readable
    torch.testing.assert_close(second, fn(*batch(2, seed=2)))


def test_clones_and_new_results_are_not_poisoned():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    out = r(*batch(3))
    kept = out.clone()
    derived = out * 2
    r(*batch(3, seed=5))
    assert type(kept) is torch.Tensor
    torch.testing.assert_close(derived, kept * 2)


def test_copy_outputs_and_eager_fallback_are_never_poisoned():
    fn, _ = closure_model()
    r = make(fn, options=gg.CaptureOptions(copy_outputs=True))
    r.capture()
    a = r(*batch(3))
    r(*batch(3, seed=4))
    _ = a + 1
    r2 = make(fn)
    r2.capture()
    big = r2(*batch(20))  # above the largest size: eager, owned
    r2(*batch(2))
    _ = big + 1


def test_release_poisons_live_outputs():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    out = r(*batch(3))
    r.release()
    with pytest.raises((StaleOutputError, RuntimeError), match=r"release\(\)"):
        _ = out.sum()


# --------------------------------------------------------------------------- unsafe ops


def test_item_in_the_callable_names_the_op_and_the_line():
    w = torch.randn(6, 6)

    def fn(x, idx):
        scale = x.abs().max().item()  # UNSAFE-LINE
        return x @ w * scale + idx[:, None].to(x.dtype)

    r = make(fn)
    with pytest.raises(CaptureUnsafeOpError) as info:
        r.capture()
    msg = str(info.value)
    print(msg)
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if "# UNSAFE-LINE" in text and "scale" in text
    )
    assert "aten._local_scalar_dense" in msg
    assert f"test_sanitizer.py:{line}" in msg
    # A warmup may read the host; the capture may not: refused there, before the op ran.
    assert "during the capture of size 8" in msg
    assert r.backend.names().count("capture_begin") == 1
    assert r.backend.names().count("capture_abort") == 1


@pytest.mark.parametrize(
    "body, op",
    [
        (lambda x: x[x > 0].sum() + x, "aten.index"),
        (lambda x: torch.nonzero(x).sum() + x, "aten.nonzero"),
        (lambda x: x * float(torch.equal(x, x)), "aten.equal"),
        (lambda x: x if bool(x.sum() > 0) else -x, "aten._local_scalar_dense"),
    ],
)
def test_other_host_reads_are_flagged(body, op):
    def fn(x, idx):
        return body(x) + idx[:, None].to(x.dtype)

    with pytest.raises(CaptureUnsafeOpError, match=op.replace(".", r"\.")):
        make(fn).capture()


def test_unsafe_op_is_flagged_even_without_warmups():
    def fn(x, idx):
        return x * x.sum().item() + idx[:, None].to(x.dtype)

    with pytest.raises(CaptureUnsafeOpError, match="during the capture of size 8"):
        make(fn, options=gg.CaptureOptions(warmup_iters=0)).capture()


def test_clean_callable_has_no_false_positive():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    for step, n in zip(range(200), itertools.cycle([1, 3, 8, 2, 7, 20])):
        x = batch(n, seed=step)
        out = r(*x)
        torch.testing.assert_close(out, fn(*x))
    assert verify(r).ok


def test_plain_runner_has_no_sanitizer_work(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)

    def fn(x, idx):
        return x * x.sum().item() + idx[:, None].to(x.dtype)

    r = make(fn, sanitize=False)
    r.capture()  # .item() is legal on the CPU emulation: no warmup monitor refuses it
    # The plain class: no sanitizer class anywhere in its method resolution order.
    assert type(r) is GraphRunner and r._sanitizer is None
    assert [c for c in type(r).__mro__ if c.__module__.startswith("graphguard.sanitizer")] == []
    # The plain replay path: the graph's own output views, no guard, no poisoning. (That a
    # plain import and capture load no sanitizer module is tests/test_layout.py's rule.)
    x, idx = batch(3, seed=1)
    out = r(x, idx)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, fn(x, idx))
    again = r(*batch(3, seed=2))
    assert again.data_ptr() == out.data_ptr()  # the same static memory, handed out again
    _ = out + 1  # reading a stale output is the caller's business: nothing raises


# --------------------------------------------------------------------------- busy streams


class FakeStream:
    def __init__(self, busy):
        self.busy = busy

    def query(self):
        return not self.busy


def test_busy_stream_registered_by_the_sanitizer_fails_capture():
    """The sanitizer registers warmup streams (CUDA only); the lifecycle then checks them."""
    s = FakeStream(busy=True)
    streams.watch_stream(s, "side stream seen during warmup")
    fn, _ = closure_model()
    try:
        with pytest.raises(BusyStreamError, match="side stream seen during warmup"):
            make(fn).capture()
    finally:
        streams.unwatch_stream(s)


# --------------------------------------------------------------------------- verify


def test_verify_report_data_and_table():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    report = r.verify()
    assert isinstance(report, VerifyReport)
    assert report.ok and report.failed == []
    assert [s.size for s in report.sizes] == list(SIZES)
    d = report.to_dict()
    assert d["ok"] and len(d["sizes"]) == 4 and d["sizes"][0]["dtype"] == "float32"
    table = report.table()
    print(table)
    assert "all match eager" in table
    assert "max_abs" in table and "max_rel" in table
    assert table.count("yes") == 4


def test_verify_works_on_a_plain_runner_with_custom_inputs_and_sizes(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    fn, _ = closure_model()
    r = make(fn, sanitize=False)
    r.capture()
    seen = []

    def make_inputs(n):
        seen.append(n)
        return batch(n, seed=n)

    report = verify(r, make_inputs=make_inputs, sizes=[2, 8])
    assert seen == [2, 2, 8, 8]  # two input sets per size
    assert report.ok
    with pytest.raises(ConfigError, match=r"\[3\]"):
        verify(r, sizes=[3])


def test_planted_divergence_raises_naming_the_sizes():
    """On the CPU emulation a replay re-runs the body, so the divergence is planted in the
    reference path (the GPU test plants it in the captured graph instead)."""
    fn, _ = closure_model()
    r = make(fn)
    r.capture()

    def eager(x, idx):
        out = fn(x, idx)
        return out + 1.0 if x.shape[0] in (2, 4) else out

    r.eager = eager
    with pytest.raises(DivergenceError) as info:
        r.verify()
    msg = str(info.value)
    print(msg)
    assert "size(s) [2, 4]" in msg
    assert msg.count("NO") == 2
    report = info.value.report
    assert report.failed == [2, 4]
    assert report.sizes[1].max_abs == pytest.approx(1.0)
    assert report.sizes[0].ok and report.sizes[0].max_abs == 0.0


def test_verify_without_raising_returns_the_failing_report():
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    r.eager = lambda x, idx: fn(x, idx) * 1.01
    report = r.verify(raise_on_fail=False, sizes=[4])
    assert not report.ok and report.failed == [4]
    loose = r.verify(raise_on_fail=False, sizes=[4], rtol=0.05, atol=1e-3)
    assert loose.ok


def test_verify_integer_outputs_compare_exactly():
    def fn(x, idx):
        return idx * 2, x + 1

    r = make(fn)
    r.capture()
    report = r.verify()
    assert report.ok
    assert sanitizer.default_tolerance(torch.int64) == (0.0, 0.0)
    assert (
        sanitizer.default_tolerance(torch.bfloat16)[0]
        > sanitizer.default_tolerance(torch.float32)[0]
    )


def test_zero_copy_replay_is_checked_and_guarded():
    fn, state = closure_model()
    r = make(fn)
    r.capture()
    if not hasattr(GraphRunner, "replay"):
        pytest.skip("this runner has no zero-copy replay")
    x, idx = batch(3)
    for dst, src in zip(r.static_inputs(3), (x, idx)):
        dst.copy_(src)
    out = r.replay(3)
    torch.testing.assert_close(out, fn(x, idx))
    r.replay(3)
    with pytest.raises((StaleOutputError, RuntimeError), match="call #1"):
        _ = out + 1
    state["w"] = torch.randn(6, 6)
    with pytest.raises(FreedStorageError):
        r.replay(3)


def test_poisoning_path_aliases_outputs_and_poisons_the_previous_storages(monkeypatch):
    """The CUDA path (storage poisoning), with the private poison call recorded instead:
    CPU builds lack it, but the aliasing half runs here for real."""
    poisoned = []
    monkeypatch.setattr(stale, "POISON", lambda cdata, msg: poisoned.append((cdata, msg)))
    fn, _ = closure_model()
    r = make(fn)
    r.capture()
    x = batch(3)
    out = r(*x)
    assert type(out) is torch.Tensor
    static = r.graph_outputs[4][0]  # the size-4 graph's own output
    assert out.data_ptr() == static.data_ptr()
    assert out.untyped_storage()._cdata != static.untyped_storage()._cdata  # fresh, non-owning
    torch.testing.assert_close(out, fn(*x))
    cdata = out.untyped_storage()._cdata
    r(*batch(2))
    assert [c for c, _ in poisoned] == [cdata]
    assert "call #1 (batch 3, replaying the size-4 graph)" in poisoned[0][1]
    assert "call #2 (batch 2" in poisoned[0][1]
    del out
    r(*batch(2))  # the caller dropped call #2's output: nothing left to poison
    assert len(poisoned) == 1


def test_no_false_positive_with_inference_tensors():
    """Under inference_mode graphguard compares input contents itself (torch.equal);
    only the user's callable is inspected, so that is not flagged."""
    fn, _ = closure_model()
    with torch.inference_mode():
        r = make(fn)
        r.capture()
        out = r(*batch(3))
        torch.testing.assert_close(out, fn(*batch(3)))
        assert r.verify().ok


# --------------------------------------------------------------------------- rebinding


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])

    def forward(self, x, idx):
        return self.layers[1](self.layers[0](x)) + idx[:, None].to(x.dtype)


def test_weight_rebound_after_capture_raises_before_replay_naming_the_path():
    m = TwoLayer()
    with torch.no_grad():
        r = make(m)
        r.capture()
        r(*batch(3))
        old = m.layers[0].weight  # still referenced: nothing is freed
        m.layers[0].weight = torch.nn.Parameter(torch.randn(6, 6))
        events = len(r.backend.events)
        with pytest.raises(gg.errors.ReboundTensorError) as info:
            r(*batch(3))
    msg = str(info.value)
    print(msg)
    assert info.value.path == "TwoLayer.layers.0.weight"
    assert "TwoLayer.layers.0.weight was rebound after capture" in msg
    assert "still reads the old tensor" in msg and "recapture(reason=" in msg
    assert r.backend.events[events:] == []  # nothing was replayed
    assert old.shape == (6, 6)


def test_in_place_weight_update_and_recapture_are_not_flagged():
    m = TwoLayer()
    with torch.no_grad():
        r = make(m)
        r.capture()
        m.layers[1].weight.copy_(torch.randn(6, 6))  # same storage: the graph sees it
        x = batch(2)
        torch.testing.assert_close(r(*x), m(*x))
        old = m.layers[1].weight
        m.layers[1].weight = torch.nn.Parameter(torch.randn(6, 6))
        with pytest.raises(gg.errors.ReboundTensorError, match=r"layers\.1\.weight"):
            r.check_storages()
        del old
        r.recapture(reason="weights swapped")
        torch.testing.assert_close(r(*x), m(*x))


def test_rebound_dict_entry_whose_old_tensor_lives_on_is_named():
    fn, state = closure_model()
    keep = state["w"]
    r = make(fn)
    r.capture()
    state["w"] = torch.randn(6, 6)  # the old tensor is still alive in `keep`
    with pytest.raises(gg.errors.ReboundTensorError, match=r"state\['w'\] was rebound"):
        r(*batch(2))
    assert keep.numel() == 36


def test_tensors_of_a_plain_callable_object_are_named():
    class Scorer:
        def __init__(self):
            self.w = torch.randn(6, 6)
            self.bias = {"b": torch.randn(6)}

        def __call__(self, x, idx):
            return x @ self.w + self.bias["b"] + idx[:, None].to(x.dtype)

    s = Scorer()
    r = make(s)
    r.capture()
    names = {t.name for t in r.watched_storages(4)}
    assert {"Scorer.w", "Scorer.bias['b']"} <= names, names
    assert None not in names
    s.w = torch.randn(6, 6)  # old one freed
    with pytest.raises(FreedStorageError, match=r"Scorer\.w"):
        r(*batch(2))


# --------------------------------------------------------------------------- arenas on two streams


def test_one_arena_on_the_main_stream_and_a_branch_in_one_step_is_caught():
    arena = gg.Workspace("scratch", "cpu")
    aux = gg.AuxStream("gate", "cpu")

    def fn(x, idx):
        (a,) = arena.get((x.shape, x.dtype))  # MAIN-GET
        torch.mul(x, 2.0, out=a)
        with aux.fork(x):
            (b,) = arena.get((x.shape, x.dtype))  # BRANCH-GET
            torch.mul(x, 3.0, out=b)
        return a + b + idx[:, None].to(x.dtype)

    r = make(fn, workspaces=[arena])
    with pytest.raises(gg.errors.ArenaStreamAliasError) as info:
        r.capture()
    msg = str(info.value)
    print(msg)
    assert info.value.arena == "scratch"
    assert "the main stream" in msg and "auxiliary branch 'gate'" in msg
    assert "offset 0" in msg and "own arena" in msg
    assert all("test_sanitizer.py:" in s for s in info.value.sites)
    assert "uncaptured warmup of size 8" in msg  # found before anything could race


def test_one_arena_per_stream_and_on_main_are_fine():
    main_arena, aux_arena = gg.Workspace("main", "cpu"), gg.Workspace("branch", "cpu")
    aux = gg.AuxStream("gate", "cpu")

    def fn(x, idx):
        (a,) = main_arena.get((x.shape, x.dtype))
        torch.mul(x, 2.0, out=a)
        with aux.fork(x) as br:
            (b,) = aux_arena.get((x.shape, x.dtype))
            torch.mul(x, 3.0, out=b)
            with br.on_main():
                (c,) = main_arena.get((x.shape, x.dtype))  # main stream again: same key
                c.copy_(a)
        return c + b + idx[:, None].to(x.dtype)

    r = make(fn, workspaces=[main_arena, aux_arena])
    r.capture()
    x = batch(3)
    torch.testing.assert_close(r(*x), fn(*x))
    assert main_arena._observer is None and aux_arena._observer is None  # removed after


def test_plain_runner_does_not_watch_arenas(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)
    arena = gg.Workspace("scratch", "cpu")
    aux = gg.AuxStream("gate", "cpu")

    def fn(x, idx):
        (a,) = arena.get((x.shape, x.dtype))
        with aux.fork(x):
            (b,) = arena.get((x.shape, x.dtype))
        return a + b + idx[:, None].to(x.dtype)

    make(fn, sanitize=False, workspaces=[arena]).capture()


# --------------------------------------------------------------------------- threads


def test_explicit_sync_check_raises_only_on_the_warming_thread(monkeypatch):
    """Another thread's torch.cuda.synchronize() is untouched while a warmup is checked."""
    import threading

    from graphguard.sanitizer import unsafe

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("orig"))
    original = torch.cuda.synchronize
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def warming():
        try:
            with unsafe.explicit_syncs_raise("GraphRunner(f)", 8):
                inside.set()
                release.wait(10)
                torch.cuda.synchronize()  # the warming thread: refused
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=warming)
    t.start()
    assert inside.wait(10)
    torch.cuda.synchronize()  # another thread, while the warmup is checked: passes through
    assert calls == ["orig"]
    release.set()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], CaptureUnsafeOpError)
    assert "torch.cuda.synchronize()" in str(errors[0]) and "size 8" in str(errors[0])
    assert "test_sanitizer.py:" in str(errors[0])
    assert torch.cuda.synchronize is original  # restored once the last warming thread left


def test_overlapping_warmups_on_two_threads_restore_the_original_once(monkeypatch):
    import threading

    from graphguard.sanitizer import unsafe

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    original = torch.cuda.synchronize
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with unsafe.explicit_syncs_raise("A", 1):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    t = threading.Thread(target=first)
    t.start()
    a_in.wait(10)
    with unsafe.explicit_syncs_raise("B", 2):
        b_in.set()
        a_out.wait(10)
        assert torch.cuda.synchronize is not original  # B still armed after A left
        with pytest.raises(CaptureUnsafeOpError, match=r"^B: "):
            torch.cuda.synchronize()
    t.join(10)
    assert torch.cuda.synchronize is original


def test_warmups_leave_the_process_wide_sync_debug_mode_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: calls.append(m))
    fn, _ = closure_model()
    make(fn).capture()
    assert calls == []
