"""GPU tests: they need CUDA and are skipped without it (run them on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from graphguard import phase


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_phase():
    phase.reset()
    yield
    phase.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def no_tf32():
    """fp32 GEMMs without TF32 for the module (graph-vs-eager tolerances assume it)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="session")
def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (nominal H200 ~1.98e6),
    for tests that need a kernel to run a known time (a busy stream)."""
    import statistics

    probe = 5_000_000
    times = []
    for _ in range(4):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times[1:])
    cpm = max(probe / max(ms, 1e-3), 1e5)
    print(f"[gpu] _sleep calibration: {probe} cycles took {times} ms -> {cpm:.3e} cycles/ms")
    return cpm
