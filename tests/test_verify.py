"""verify() on any runner (duck-typed by graphguard.verify.Verifiable) and with declared state."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, DivergenceError, GraphGuardError
from graphguard.verify import VerifyReport, verify


class FakeState:
    """The StateSet API verify relies on: snapshot() clones, restore() copies back in place."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors
        self.restores = 0

    def snapshot(self) -> object:
        return [t.clone() for t in self.tensors]

    def restore(self, snap: object) -> None:
        self.restores += 1
        for t, s in zip(self.tensors, snap):  # type: ignore[call-overload]
            t.copy_(s)

    def __bool__(self) -> bool:
        return bool(self.tensors)


def counter_step():
    """A step that advances a device-side position counter (like a static KV cache)."""
    pos = torch.zeros((), dtype=torch.long)

    def fn(x):
        pos.add_(1)
        return x * pos.to(x.dtype)

    return fn, pos


def make(fn, **kw):
    return gg.GraphRunner(
        fn, (torch.zeros(2, 3),), sizes=(1, 2, 4), backend=RecordingBackend(), progress=False, **kw
    )


def test_stateful_step_diverges_without_declared_state():
    fn, _pos = counter_step()
    r = make(fn, sanitize=False)
    r.capture()
    with pytest.raises(DivergenceError) as info:
        verify(r)
    assert isinstance(info.value.report, VerifyReport)
    assert info.value.report.failed == [1, 2, 4]
    assert "declare it" in str(info.value)


def test_declared_state_makes_both_paths_start_equal_and_is_left_as_found():
    fn, pos = counter_step()
    r = make(fn, sanitize=False)
    r.capture()
    pos.fill_(41)
    r.state = FakeState(pos)
    report = verify(r)
    assert report.ok and [s.size for s in report.sizes] == [1, 2, 4]
    assert int(pos) == 41  # verify left the state as it found it
    assert r.state.restores == 2 * 2 * 3 + 1  # before replay and eager, two sets per size; end


def test_state_is_restored_even_when_verify_raises():
    fn, pos = counter_step()
    r = make(fn, sanitize=False)
    r.capture()
    pos.fill_(7)
    r.state = FakeState(pos)

    def broken(*_):
        raise RuntimeError("eager blew up")

    r.eager = broken
    with pytest.raises(RuntimeError, match="eager blew up"):
        verify(r)
    assert int(pos) == 7


def test_empty_state_is_ignored():
    fn, _ = counter_step()
    r = make(fn, sanitize=False)
    r.capture()
    r.state = FakeState()  # falsy: nothing declared
    assert not verify(r, raise_on_fail=False).ok
    assert r.state.restores == 0


class MinimalRunner:
    """Not a GraphRunner: only what the Verifiable protocol asks for."""

    name = "minimal"

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    @property
    def captured_sizes(self):
        return self.inner.captured_sizes

    @property
    def specs(self):
        return self.inner.specs

    def __call__(self, *inputs):
        self.calls += 1
        return self.inner(*inputs)

    def eager(self, *inputs):
        return self.inner.eager(*inputs)


def test_verify_works_on_any_runner_shape():
    w = torch.randn(3, 3)
    r = make(lambda x: x @ w, sanitize=False)
    r.capture()
    m = MinimalRunner(r)
    report = verify(m, sizes=[2, 4])
    assert report.ok and m.calls == 4  # two input sets per size
    assert report.runner == "MinimalRunner(minimal)"
    with pytest.raises(ConfigError, match=r"\[3\].*captured \[1, 2, 4\]"):
        verify(m, sizes=[3])


def test_runner_verify_method_and_sanitizer_reexport_are_the_same_function():
    from graphguard import sanitizer

    assert sanitizer.verify is verify is gg.verify
    w = torch.randn(3, 3)
    r = make(lambda x: x @ w, sanitize=True)
    r.capture()
    assert r.verify().ok


def test_all_zero_outputs_are_flagged_as_proving_nothing(caplog):
    # Token ids filled with the padding value 0, whose embedding row is zero: every output
    # is zero, and replay and eager would agree whatever memory a graph read.
    table = torch.randn(10, 4)
    table[0] = 0

    def embed(ids):
        return table[ids]

    runner = gg.GraphRunner(
        embed,
        (torch.zeros(2, dtype=torch.long),),
        sizes=(1, 2),
        backend=RecordingBackend(),
        progress=False,
    )
    runner.capture()
    with caplog.at_level("WARNING", logger="graphguard"):
        assert runner.verify().ok
    assert "zero at every size" in caplog.text and "make_inputs=" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="graphguard"):
        runner.verify(make_inputs=lambda n: (torch.arange(1, n + 1),))
    assert "zero at every size" not in caplog.text


def test_verify_of_any_runner_shape_with_no_graph_raises_instead_of_reporting_ok():
    w = torch.randn(3, 3)
    r = make(lambda x: x @ w, sanitize=False)
    m = MinimalRunner(r)  # no report, no mode: only the Verifiable protocol
    with pytest.raises(GraphGuardError, match=r"MinimalRunner\(minimal\): verify\(\) has nothing"):
        verify(m)
    assert m.calls == 0
    r.capture()
    assert verify(m).ok and m.calls == 6  # two input sets per size
