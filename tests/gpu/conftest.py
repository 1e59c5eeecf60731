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
