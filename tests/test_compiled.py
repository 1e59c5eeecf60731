"""``compile=True`` / ``CompiledStep``: one Inductor compile serves a whole ladder (CPU,
RecordingBackend).

Inductor on the CPU compiles in seconds to tens of seconds here, so the module compiles
one tiny step once (module fixture) and every test reads that runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.compiled import CompiledStep, compiled_capture_sizes
from graphguard.errors import ConfigError, GraphGuardError

_W = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
_SCALE = {"value": 2.0}


def step(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two inputs (the second batched along dim 0 too), two outputs, a Python constant
    dynamo guards on (``_SCALE``)."""
    h = torch.relu(x @ _W) * _SCALE["value"]
    return h + ids.unsqueeze(-1).to(h.dtype), h.sum(-1)


@pytest.fixture(scope="module")
def captured() -> Iterator[tuple[gg.GraphRunner, CompiledStep]]:
    torch._dynamo.reset()
    example = (torch.randn(8, 16), torch.arange(8))
    runner = gg.GraphRunner(
        step, example, compile=True, backend=gg.RecordingBackend(), progress=False
    )
    runner.capture()
    assert runner.compiled_step is not None
    yield runner, runner.compiled_step
    phase.reset()
    torch._dynamo.reset()


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 16, generator=g), torch.randint(0, 9, (n,), generator=g)


@pytest.mark.compile
def test_compile_option_captures_the_ladder_from_one_compile(captured: Any) -> None:
    runner, compiled = captured
    # Without sizes: compiled_capture_sizes(8), batch 1 pads to 2 (one compile).
    assert runner.captured_sizes == (2, 4, 8) == tuple(compiled_capture_sizes(8))
    assert compiled.compiles == 1, compiled.recompile_reasons
    report = runner.report
    assert report is not None and report.compiles == 1 and report.recompiles == []
    assert 0 < report.compile_s <= report.total_s
    assert "compiling" in report.summary()
    for n in [1, 2, 3, 5, 7, 8]:
        x, ids = _inputs(n)
        got = runner(x, ids)
        want = step(x, ids)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert runner.eager(*_inputs(3))[0].shape == (3, 24)  # eager: the uncompiled fn
    assert compiled.compiles == 1, compiled.recompile_reasons


@pytest.mark.compile
def test_recompile_while_serving_raises_with_the_guard(captured: Any) -> None:
    _, compiled = captured
    phase.set_serving()
    _SCALE["value"] = 3.0  # a guard of the compiled frame no longer holds
    try:
        with pytest.raises(GraphGuardError, match="recompile while serving") as info:
            compiled(*_inputs(3))
        assert "_SCALE" in str(info.value) or "value" in str(info.value)
    finally:
        _SCALE["value"] = 2.0
    assert compiled.compiles == 1


@pytest.mark.compile
def test_compile_option_is_validated_and_reports_size_one(caplog: Any) -> None:
    example = (torch.randn(8, 16), torch.arange(8))
    with pytest.raises(ConfigError, match="compile must be True or False"):
        gg.GraphRunner(step, example, compile="yes", progress=False)
    with pytest.raises(ConfigError, match="already a CompiledStep"):
        gg.GraphRunner(CompiledStep(step), example, compile=True, progress=False)
    with caplog.at_level("INFO", logger="graphguard"):
        r = gg.GraphRunner(step, example, compile=True, sizes=[1, 2, 8], progress=False)
    assert r.sizes == (1, 2, 8)  # allowed, and the extra compile is announced
    assert any("size 1" in m.getMessage() for m in caplog.records)
    plain = gg.GraphRunner(step, example, progress=False)
    assert plain.compiled_step is None and 1 in plain.sizes


@pytest.mark.compile
def test_cudagraph_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="max-autotune-no-cudagraphs"):
        CompiledStep(step, mode="reduce-overhead")
    with pytest.raises(ConfigError, match=r"triton\.cudagraphs"):
        CompiledStep(step, options={"triton.cudagraphs": True})
    assert CompiledStep(step, mode="max-autotune-no-cudagraphs").compiles == 0


def test_compiled_ladder_drops_only_size_one() -> None:
    assert compiled_capture_sizes(16) == [2, 4, 8, 16]
    assert compiled_capture_sizes(1) == [1]
    assert compiled_capture_sizes(256)[-1] == 256 and 1 not in compiled_capture_sizes(256)
