"""Auxiliary-stream fork/join and the idle check before capture (seed 000)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase, streams
from graphguard.errors import BusyStreamError, ConfigError, GraphGuardError
from graphguard.phase import Phase
from graphguard.streams import AuxStream, Branch, fork_decision


@pytest.fixture(autouse=True)
def _reset_phase() -> Iterator[None]:
    phase.reset()
    yield
    phase.reset()


class FakeStream:
    """A stream stand-in: a name and a scripted ``query()``."""

    def __init__(self, label: str, idle: bool = True) -> None:
        self.label = label
        self.idle = idle

    def query(self) -> bool:
        return self.idle

    def __repr__(self) -> str:
        return f"FakeStream({self.label})"


class FakeBackend:
    """Records every stream operation in order, so the fork/join protocol is visible."""

    def __init__(self, available: bool = True) -> None:
        self.is_available = available
        self.main = FakeStream("main")
        self.current: FakeStream = self.main
        self.calls: list[tuple[Any, ...]] = []
        self.created: list[FakeStream] = []
        self._events = 0

    def available(self, device: torch.device) -> bool:
        return self.is_available

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def new_stream(self, device: torch.device, priority: int) -> FakeStream:
        s = FakeStream(f"aux{len(self.created)}")
        self.created.append(s)
        self.calls.append(("new_stream", s.label, priority))
        return s

    def record_event(self, stream: FakeStream) -> str:
        self._events += 1
        event = f"ev{self._events}"
        self.calls.append(("record", stream.label, event))
        return event

    def wait_event(self, stream: FakeStream, event: str) -> None:
        self.calls.append(("wait", stream.label, event))

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        previous = self.current
        self.current = stream
        self.calls.append(("enter", stream.label))
        try:
            yield
        finally:
            self.current = previous
            self.calls.append(("exit", stream.label))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.calls.append(("record_stream", tensor.data_ptr(), stream.label))


# ---------------------------------------------------------------- policy


@pytest.mark.parametrize(
    ("overlap_allowed", "stream_available", "expected"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_fork_decision_forks_only_when_overlap_allowed_and_stream_exists(
    overlap_allowed: bool, stream_available: bool, expected: bool
) -> None:
    assert (
        fork_decision(overlap_allowed=overlap_allowed, stream_available=stream_available)
        is expected
    )


def test_fork_runs_inline_during_uncaptured_warmup_and_enqueues_nothing_on_streams() -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    with phase.enter(Phase.WARMUP), aux.fork(torch.ones(2)) as branch:
        assert backend.current is backend.main
        branch.keep(torch.zeros(2))
    assert not branch.overlapped
    assert branch.stream is None
    # The stream is created (so a later capture need not create one) but no event,
    # wait, stream switch or allocator bookkeeping happened.
    assert backend.calls == [("new_stream", "aux0", 0)]
    assert aux.stream is backend.created[0]


@pytest.mark.parametrize("where", ["eager", "capture", "serving", "profiling-capture"])
def test_fork_overlaps_outside_uncaptured_warmup(where: str) -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    ctx: contextlib.AbstractContextManager[None]
    if where == "capture":
        ctx = phase.enter(Phase.CAPTURE)
    elif where == "profiling-capture":
        ctx = phase.enter(Phase.CAPTURE, profiling=True)
    else:
        if where == "serving":
            phase.set_serving()
        ctx = contextlib.nullcontext()
    with ctx, aux.fork() as branch:
        assert backend.current is aux.stream
    assert branch.overlapped
    assert branch.stream is aux.stream


def test_fork_order_is_event_on_main_aux_waits_switch_then_join_back() -> None:
    backend = FakeBackend()
    aux = AuxStream("prefetch", "cuda", priority=-1, backend=backend)
    x = torch.arange(4.0)
    with aux.fork(x) as branch:
        backend.calls.append(("body", backend.current.label))
        y = x * 2
        branch.keep(y)
    assert backend.calls == [
        ("new_stream", "aux0", -1),
        ("record", "main", "ev1"),
        ("wait", "aux0", "ev1"),
        ("record_stream", x.data_ptr(), "aux0"),
        ("enter", "aux0"),
        ("body", "aux0"),
        ("record_stream", y.data_ptr(), "main"),
        ("exit", "aux0"),
        ("record", "aux0", "ev2"),
        ("wait", "main", "ev2"),
    ]
    assert backend.current is backend.main


def test_fork_joins_back_even_when_the_body_raises() -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    with pytest.raises(RuntimeError, match="kernel failed"), aux.fork():
        raise RuntimeError("kernel failed")
    assert backend.calls[-3:] == [
        ("exit", "aux0"),
        ("record", "aux0", "ev2"),
        ("wait", "main", "ev2"),
    ]
    assert backend.current is backend.main


def test_stream_is_created_once_and_reused_across_forks() -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    with aux.fork():
        pass
    first = aux.stream
    with aux.fork():
        pass
    assert aux.stream is first
    assert len(backend.created) == 1


def test_fork_joins_to_whatever_stream_is_current_such_as_the_capture_stream() -> None:
    backend = FakeBackend()
    capture_stream = FakeStream("capture")
    backend.current = capture_stream
    aux = AuxStream("gate", "cuda", backend=backend)
    with phase.enter(Phase.CAPTURE), aux.fork():
        pass
    assert ("record", "capture", "ev1") in backend.calls
    assert backend.calls[-1] == ("wait", "capture", "ev2")


def test_cpu_aux_stream_runs_inline_and_computes_the_same_result() -> None:
    aux = AuxStream("cpu-branch", "cpu")
    x = torch.arange(6.0)
    with aux.fork(x) as branch:
        y = x + 1
        branch.keep(y)
    assert not branch.overlapped
    assert aux.stream is None
    assert torch.equal(y, torch.arange(1.0, 7.0))


def test_inline_fork_when_backend_has_no_stream_even_while_serving() -> None:
    phase.set_serving()
    backend = FakeBackend(available=False)
    aux = AuxStream("gate", "cuda", backend=backend)
    with aux.fork() as branch:
        pass
    assert not branch.overlapped
    assert backend.calls == []
    assert aux.stream is None


def test_default_device_follows_cuda_availability() -> None:
    aux = AuxStream()
    assert aux.name == "aux"
    assert aux.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_branch_keep_is_noop_inline() -> None:
    backend = FakeBackend()
    branch = Branch(overlapped=False, stream=None, main=None, backend=backend)
    branch.keep(torch.ones(1))
    assert backend.calls == []


# ---------------------------------------------------------------- registry


def _names() -> list[str]:
    return [name for name, _ in streams.known_streams()]


def test_watch_stream_is_listed_and_weakly_held() -> None:
    s = FakeStream("capture")
    streams.watch_stream(s, "runner-capture-weak")
    assert "runner-capture-weak" in _names()
    del s
    gc.collect()
    assert "runner-capture-weak" not in _names()


def test_the_registry_runs_no_code_in_the_garbage_collector_and_drops_dead_entries() -> None:
    """No weak-reference callback: a Ctrl-C that lands during a collection must reach the
    caller, not be swallowed in a graphguard callback ("Exception ignored in _drop")."""
    s = FakeStream("capture")
    streams.watch_stream(s, "no-callback")
    aux = AuxStream("no-callback-aux", "cpu")
    assert [r.__callback__ for r in weakref.getweakrefs(s) + weakref.getweakrefs(aux)] == [
        None,
        None,
    ]
    before = len(streams._registry)
    del s, aux
    gc.collect()
    streams.watch_stream(FakeStream("other"), "next")  # adding drops the dead entries
    assert len(streams._registry) == before - 1


def test_registering_the_same_stream_again_renames_it_and_unregister_removes_it() -> None:
    s = FakeStream("capture")
    streams.watch_stream(s, "first-name")
    streams.watch_stream(s, "second-name")
    names = _names()
    assert "first-name" not in names
    assert names.count("second-name") == 1
    streams.unwatch_stream(s)
    assert "second-name" not in _names()


def test_aux_stream_registers_its_stream_on_first_fork_and_drops_it_with_the_aux() -> None:
    backend = FakeBackend()
    aux = AuxStream("lazy-aux-registry", "cuda", backend=backend)
    assert "lazy-aux-registry" not in _names()
    with phase.enter(Phase.WARMUP), aux.fork():
        pass
    assert ("lazy-aux-registry", aux.stream) in streams.known_streams()
    del aux  # the backend still holds the stream object: only the AuxStream counts
    gc.collect()
    assert "lazy-aux-registry" not in _names()


def test_busy_streams_names_exactly_the_streams_whose_query_is_false() -> None:
    idle = FakeStream("idle", idle=True)
    busy = FakeStream("busy", idle=False)
    streams.watch_stream(idle, "idle-one")
    streams.watch_stream(busy, "busy-one")
    try:
        result = streams.busy_streams()
        assert "busy-one" in result
        assert "idle-one" not in result
        busy.idle = True
        assert "busy-one" not in streams.busy_streams()
    finally:
        streams.unwatch_stream(idle)
        streams.unwatch_stream(busy)


def test_busy_aux_stream_is_reported_by_its_name() -> None:
    backend = FakeBackend()
    aux = AuxStream("kda-gate", "cuda", backend=backend)
    with aux.fork():
        pass
    aux.stream.idle = False
    assert "kda-gate" in streams.busy_streams()
    aux.stream.idle = True
    assert "kda-gate" not in streams.busy_streams()


def test_assert_streams_idle_passes_when_all_known_streams_are_idle() -> None:
    s = FakeStream("x", idle=True)
    streams.watch_stream(s, "quiet")
    try:
        streams.assert_streams_idle("before capturing size 8")
    finally:
        streams.unwatch_stream(s)


def test_assert_streams_idle_names_busy_streams_where_and_the_fix() -> None:
    a = FakeStream("a", idle=False)
    b = FakeStream("b", idle=False)
    streams.watch_stream(a, "l2-prefetch")
    streams.watch_stream(b, "kda-gate")
    try:
        with pytest.raises(BusyStreamError) as info:
            streams.assert_streams_idle("before capturing size 64")
    finally:
        streams.unwatch_stream(a)
        streams.unwatch_stream(b)
    err = info.value
    assert isinstance(err, GraphGuardError)
    msg = str(err)
    assert "'l2-prefetch'" in msg
    assert "'kda-gate'" in msg
    assert "before capturing size 64" in msg
    assert "synchronize" in msg
    assert "overlap_allowed()" in msg


def test_watch_stream_rejects_objects_without_query() -> None:
    with pytest.raises(ConfigError, match="query"):
        streams.watch_stream(object(), "no-query")
    assert "no-query" not in _names()


def test_aux_stream_whose_backend_stream_has_no_query_is_left_out_of_the_idle_check() -> None:
    class OpaqueBackend(FakeBackend):
        def new_stream(self, device: torch.device, priority: int) -> Any:
            return "opaque-stream"

    aux = AuxStream("opaque-aux", "cuda", backend=OpaqueBackend())
    with phase.enter(Phase.WARMUP), aux.fork():
        pass
    assert aux.stream == "opaque-stream"
    assert "opaque-aux" not in _names()
    streams.assert_streams_idle("with an opaque stream around")


def test_unweakrefable_stream_is_held_until_unregistered() -> None:
    class Slotted:
        __slots__ = ()

        def query(self) -> bool:
            return False

    s = Slotted()
    streams.watch_stream(s, "slotted")
    try:
        assert "slotted" in streams.busy_streams()
    finally:
        streams.unwatch_stream(s)
    assert "slotted" not in _names()


# ---------------------------------------------------------------- real CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fork_overlaps_and_joins_with_correct_result() -> None:
    aux = AuxStream("cuda-fork-test", "cuda")
    x = torch.arange(1024.0, device="cuda")
    with aux.fork(x) as branch:
        assert torch.cuda.current_stream() == aux.stream
        y = x * 2
        branch.keep(y)
    assert branch.overlapped
    z = y + x  # on the main stream, after the join
    torch.cuda.synchronize()
    assert torch.equal(z, x * 3)
    assert "cuda-fork-test" not in streams.busy_streams()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fork_inside_graph_capture_replays_correctly() -> None:
    aux = AuxStream("cuda-capture-test", "cuda")
    x = torch.arange(1024.0, device="cuda")

    def step() -> torch.Tensor:
        with aux.fork(x) as branch:
            y = x * 2
            branch.keep(y)
        return y + x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), phase.enter(Phase.WARMUP):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    streams.assert_streams_idle("before capturing the test graph")
    graph = torch.cuda.CUDAGraph()
    with phase.enter(Phase.CAPTURE), torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.full_like(x, 5.0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 15.0))


def test_watch_stream_is_the_public_way_to_check_a_users_own_stream() -> None:
    s = FakeStream("mine", idle=False)
    gg.watch_stream(s, "my prefetch stream")
    try:
        assert "my prefetch stream" in _names()
        with pytest.raises(BusyStreamError, match="'my prefetch stream'"):
            streams.assert_streams_idle("before capturing size 8")
    finally:
        streams.unwatch_stream(s)
    assert "my prefetch stream" not in _names()
    streams.assert_streams_idle("before capturing size 8")
    t = FakeStream("unnamed")
    gg.watch_stream(t)
    try:
        assert "FakeStream(unnamed)" in _names()  # default name: the repr
    finally:
        streams.unwatch_stream(t)


def test_watch_stream_from_many_threads_is_safe() -> None:
    import threading

    made = [FakeStream(f"t{i}") for i in range(64)]

    def worker(chunk: list[FakeStream]) -> None:
        for s in chunk:
            streams.watch_stream(s, f"threaded {s.label}")
            streams.known_streams()

    threads = [threading.Thread(target=worker, args=(made[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert {f"threaded t{i}" for i in range(64)} <= set(_names())
    finally:
        for s in made:
            streams.unwatch_stream(s)
    assert not any(n.startswith("threaded ") for n in _names())


@pytest.mark.parametrize("overlap", [False, True])
def test_current_branch_names_the_fork_inline_or_overlapped(overlap: bool) -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    ctx: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext() if overlap else phase.enter(Phase.WARMUP)
    )
    assert streams.current_branch() is None
    with ctx, aux.fork() as br:
        assert br.overlapped is overlap
        assert streams.current_branch() == "gate"
        with br.on_main():
            assert streams.current_branch() is None
        assert streams.current_branch() == "gate"
    assert streams.current_branch() is None


@pytest.mark.compile
def test_fork_runs_inline_while_torch_compile_traces_it() -> None:
    """Dynamo cannot trace record_stream or event waits: under torch.compile the branch
    runs inline, in one graph (fullgraph), with no stream operation at all."""
    backend = FakeBackend(available=True)
    aux = AuxStream("shared-expert", device="cpu", backend=backend)
    phase.set_serving()  # overlap allowed: an uncompiled fork would really fork

    def step(x: torch.Tensor) -> torch.Tensor:
        with aux.fork(x) as br:
            y = x * 2
            inline = not br.overlapped
        return y + 1 if inline else y - 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        x = torch.arange(4.0)
        torch.testing.assert_close(compiled(x), x * 2 + 1)
    finally:
        torch._dynamo.reset()
    assert backend.calls == []
    with aux.fork(x) as br:  # the same fork, uncompiled, does fork
        assert br.overlapped
    assert backend.calls


# ---------------------------------------------------------------- bad arguments (issue 20)


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        (lambda aux: aux.fork(5, "x").__enter__(), r"fork\(\*tensors\): argument 0 is int 5"),
        (lambda aux: aux.fork(torch.ones(2), None).__enter__(), "argument 1 is NoneType"),
    ],
)
def test_fork_refuses_non_tensors_in_the_inline_warmup_not_mid_capture(
    bad: Any, fragment: str
) -> None:
    """Inline (uncaptured warmup) a non-tensor input used to pass unnoticed, and the first
    overlapped fork, during capture, failed in record_stream after the fork event."""
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    with phase.enter(Phase.WARMUP), pytest.raises(ConfigError, match=fragment):
        bad(aux)
    with phase.enter(Phase.CAPTURE), pytest.raises(ConfigError, match=fragment):
        bad(aux)
    assert [c for c in backend.calls if c[0] != "new_stream"] == []  # no event queued
    x = torch.ones(2)
    with phase.enter(Phase.CAPTURE), aux.fork(x) as br:  # the stream still forks and joins
        y = x * 2
        br.keep(y)
    assert br.overlapped and [c[0] for c in backend.calls][-2:] == ["record", "wait"]
    assert torch.equal(y, torch.full((2,), 2.0))


def test_keep_refuses_non_tensors_inline_too() -> None:
    backend = FakeBackend()
    aux = AuxStream("gate", "cuda", backend=backend)
    with phase.enter(Phase.WARMUP), aux.fork() as br:
        with pytest.raises(ConfigError, match=r"keep\(\*tensors\): argument 0 is str 'x'"):
            br.keep("x")  # type: ignore[arg-type]
        br.keep(torch.ones(1))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"name": 123}, r"AuxStream\(name=...\) must be a non-empty string .*int 123"),
        ({"name": ""}, r"non-empty string"),
        ({"priority": "high"}, r"AuxStream 'aux': priority must be an int.*str 'high'"),
        ({"priority": True}, r"priority must be an int.*bool True"),
        ({"device": "bogus"}, r"device='bogus' is not a torch device \(an unknown device type\)"),
        ({"device": 2.5}, r"device=2.5 is not a torch device \(a float"),
        ({"backend": object()}, r"backend lacks \['available'"),
    ],
)
def test_auxstream_arguments_are_checked_at_construction(
    kwargs: dict[str, Any], fragment: str
) -> None:
    before = len(streams._registry)
    with pytest.raises(ConfigError, match=fragment):
        AuxStream(**kwargs)
    assert len(streams._registry) == before  # a refused AuxStream is not registered
    aux = AuxStream("ok", "cpu", priority=-1)
    with aux.fork(torch.ones(1)) as br:
        assert not br.overlapped


def test_a_stream_whose_query_fails_is_named() -> None:
    class Gone(FakeStream):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: invalid resource handle")

    gone = Gone("gone")
    gg.watch_stream(gone, "kv-prefetch")
    try:
        with pytest.raises(BusyStreamError, match=r"'kv-prefetch'.*invalid resource handle"):
            streams.assert_streams_idle("before capturing size 8")
    finally:
        streams.unwatch_stream(gone)
    streams.assert_streams_idle("before capturing size 8")  # unwatched: idle again
