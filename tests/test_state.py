"""Stateful steps: capture leaves declared state as it found it; undeclared writes are named."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.state import StateSet

MAX_LEN = 16


class Decoder(torch.nn.Module):
    """A toy decode step over a static KV cache with a device-side 0-d write position."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("kv_cache", torch.zeros(8, MAX_LEN, 4))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        k = self.proj(x)
        self.kv_cache[:n].index_copy_(1, self.pos.view(1), k[:, None, :])
        self.pos.add_(1)
        return self.kv_cache[:n].sum(dim=1)


def runner(model: Decoder, **kw: Any) -> gg.GraphRunner:
    return gg.GraphRunner(
        model.step,
        (torch.zeros(2, 4),),
        sizes=(1, 2, 4, 8),
        backend=RecordingBackend(),
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("how", ["module", "dict", "list"])
def test_capture_leaves_declared_cache_and_counter_as_it_found_them(how: str) -> None:
    torch.manual_seed(0)
    m = Decoder()
    m.kv_cache.normal_()
    m.pos.fill_(3)
    before = (m.kv_cache.clone(), m.pos.clone())
    ptrs = (m.kv_cache.data_ptr(), m.pos.data_ptr())
    state = {
        "module": m,
        "dict": {"cache": m.kv_cache, "pos": m.pos},
        "list": [m.kv_cache, m.pos],
    }[how]
    r = runner(m, state=state)
    assert r.state is not None and len(r.state) == 2
    r.capture()
    torch.testing.assert_close(m.kv_cache, before[0], rtol=0, atol=0)
    assert int(m.pos) == 3
    assert (m.kv_cache.data_ptr(), m.pos.data_ptr()) == ptrs  # restored in place
    # Then graph and eager agree step by step from the same starting state.
    ref = Decoder()
    ref.load_state_dict(m.state_dict())
    for step in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(r(x), ref.step(x))
    # Rows 0..2 are the batch; row 3 is the padding row the size-4 graph also wrote.
    torch.testing.assert_close(m.kv_cache[:3], ref.kv_cache[:3])
    assert int(m.pos) == int(ref.pos) == 8


def test_state_is_restored_when_capture_fails() -> None:
    m = Decoder()
    be = RecordingBackend()
    be.fail_on = {2}
    r = gg.GraphRunner(
        m.step, (torch.zeros(2, 4),), sizes=(2, 4), backend=be, progress=False, state=m
    )
    with pytest.raises(gg.errors.GraphCaptureError):
        r.capture()
    assert int(m.pos) == 0 and not m.kv_cache.any()


def test_undeclared_state_is_named_once_with_the_fix(caplog: Any) -> None:
    m = Decoder()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        runner(m).capture()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    msg = warnings[0]
    assert "kv_cache (float32" in msg and "pos (int64 [])" in msg
    assert "state=[" in msg
    assert "proj" not in msg  # weights are read, not written


def test_closure_and_global_state_are_named(caplog: Any) -> None:
    cache = torch.zeros(8, 3)

    def step(x: torch.Tensor) -> torch.Tensor:
        cache[: x.shape[0]].add_(x)
        return cache[: x.shape[0]] * 2

    with caplog.at_level(logging.WARNING, logger="graphguard"):
        gg.GraphRunner(
            step, (torch.zeros(2, 3),), sizes=(2,), backend=RecordingBackend(), progress=False
        ).capture()
    assert "cache (float32" in caplog.text


def test_no_warning_for_a_pure_callable_or_for_declared_state(caplog: Any) -> None:
    m = Decoder()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        runner(m, state=m).capture()
        gg.GraphRunner(
            lambda x: (x * 2).relu(),
            (torch.zeros(2, 3),),
            sizes=(1, 2),
            backend=RecordingBackend(),
            progress=False,
        ).capture()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_input_writes_are_not_reported_as_state(caplog: Any) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    with caplog.at_level(logging.WARNING, logger="graphguard"):
        gg.GraphRunner(
            fn, (torch.zeros(2, 3),), sizes=(2,), backend=RecordingBackend(), progress=False
        ).capture()
    assert "outside the static inputs" not in caplog.text


def test_stateset_api() -> None:
    a, b = torch.arange(4.0), torch.zeros((), dtype=torch.long)
    s = StateSet({"a": a, "b": b})
    assert s.names == ["a", "b"] and bool(s)
    snap = s.snapshot()
    a.add_(1)
    b.fill_(7)
    s.restore(snap)
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and int(b) == 0
    assert not StateSet([])
    assert StateSet.of(None) is None and StateSet.of(s) is s


def test_stateset_object_is_walked_again_at_each_snapshot() -> None:
    class Cache:
        def __init__(self) -> None:
            self.layers = [torch.zeros(2), torch.zeros(2)]
            self.pos = torch.zeros((), dtype=torch.long)

    c = Cache()
    s = StateSet(c)
    assert s.names == ["layers[0]", "layers[1]", "pos"]
    c.layers[1] = torch.ones(2)  # rebound after construction
    snap = s.snapshot()
    c.layers[1].fill_(5)
    s.restore(snap)
    assert c.layers[1].tolist() == [1.0, 1.0]


def test_stateset_errors() -> None:
    with pytest.raises(ConfigError, match="state="):
        StateSet(5)
    s = StateSet([torch.zeros(3)])
    with pytest.raises(ConfigError, match="snapshot"):
        s.restore("nope")  # type: ignore[arg-type]
    t = torch.zeros(3)
    s = StateSet({"t": t})
    snap = s.snapshot()
    t.resize_(5)
    with pytest.raises(GraphGuardError, match="t: float32 \\[3\\] at the snapshot"):
        s.restore(snap)


def test_stateset_restores_inference_tensors() -> None:
    with torch.inference_mode():
        t = torch.zeros(3)
    s = StateSet([t])
    snap = s.snapshot()
    with torch.inference_mode():
        t.add_(1)
    s.restore(snap)
    assert t.sum().item() == 0


def test_state_declared_empty_silences_the_warning_and_arenas_are_not_state(caplog: Any) -> None:
    arena = gg.Workspace("scratch")

    def with_arena(x: torch.Tensor) -> torch.Tensor:
        (buf,) = arena.get(((x.shape[0], 3), x.dtype))
        buf.copy_(x * 3)
        return buf + 1

    with caplog.at_level(logging.WARNING, logger="graphguard"):
        runner(Decoder(), state=[]).capture()  # declared: the writes are harmless
        gg.GraphRunner(
            with_arena,
            (torch.zeros(2, 3),),
            sizes=(1, 2),
            workspaces=[arena],
            backend=RecordingBackend(),
            progress=False,
        ).capture()
    assert "outside the static inputs" not in caplog.text, caplog.text


def test_a_long_list_of_written_tensors_is_cut_to_one_readable_line(caplog: Any) -> None:
    caches = [torch.zeros(8, 2) for _ in range(9)]

    def step(x: torch.Tensor) -> torch.Tensor:
        for c in caches:
            c[: x.shape[0]].add_(x)
        return x * 2

    with caplog.at_level(logging.WARNING, logger="graphguard"):
        gg.GraphRunner(
            step, (torch.zeros(2, 2),), sizes=(2,), backend=RecordingBackend(), progress=False
        ).capture()
    assert "and 5 more" in caplog.text, caplog.text


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        (["kv_cache", "pos"], "state[0] is str 'kv_cache', not a tensor"),
        ({"kv": "kv_cache"}, "state['kv'] is str 'kv_cache'"),
        ({"pos": 3}, "state['pos'] is int 3"),
        ([None], "state[0] is NoneType None"),
        ([torch.float32], "state[0] is dtype torch.float32"),
        ({1.5: torch.zeros(1)}, "key 1.5 (float)"),
    ],
)
def test_state_that_declares_nothing_is_refused_not_silent(bad: Any, fragment: str) -> None:
    """A name (or number) used to declare nothing *and* switch the write warning off, so
    capture changed the cache silently. Now refused; the real tensors then work."""
    m = Decoder()
    with pytest.raises(ConfigError) as ei:
        runner(m, state=bad)
    assert fragment in str(ei.value)
    m.pos.fill_(3)
    r = runner(m, state=[m.kv_cache, m.pos])
    r.capture()
    assert int(m.pos) == 3 and not m.kv_cache.any()


def test_meta_state_is_refused_by_name() -> None:
    with torch.device("meta"):
        meta = Decoder()
    with pytest.raises(ConfigError, match=r"kv_cache \(float32 \[8, 16, 4\]\).*meta device"):
        StateSet(meta)


def test_empty_object_state_warns_at_snapshot(caplog: Any) -> None:
    class Lazy:
        def __init__(self) -> None:
            self.k: torch.Tensor | None = None  # created on first use

    lazy = Lazy()
    s = StateSet(lazy)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        s.snapshot()
    assert "state=Lazy holds no tensors now" in caplog.text
    caplog.clear()
    lazy.k = torch.zeros(2)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        snap = s.snapshot()
    assert caplog.text == "" and s.names == ["k"]
    lazy.k.fill_(5)
    s.restore(snap)
    assert not lazy.k.any()
