from __future__ import annotations

import gc
import os
from typing import Any

# One intra-op thread per test process, set before torch is imported: the xdist workers
# (-n auto: one per core) already fill the cores, and on tiny tensors two OpenMP threads
# per worker spin, tripling the suite's CPU time.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor on the CPU, set before torch._inductor is first imported (the variables are
# read then; the spawned ranks and subprocesses inherit them; a value you export wins):
# - Its first compile in a process dry-compiles a test program per vector ISA the CPU
#   reports, about 5 s of g++ per worker; the suite trusts the CPU's flags instead.
# - One compile thread: the test workers already fill the cores, and a pool of compile
#   processes per worker would each import torch first.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest

from graphguard import phase

PROCESS_FIXTURES = {"fresh_interpreter", "two_ranks", "three_ranks"}
"""Fixtures that start fresh Python interpreters (the probe, the gloo ranks)."""
COMPILE_FIXTURES = {"compiled", "compiled_llama", "compiled_gpt2", "compiled_llama_model"}
"""Fixtures that compile with Inductor (tests/test_hf_integration.py)."""


def pytest_collection_modifyitems(config, items):
    """Mark the kinds by the fixtures a test uses: ``-m "not compile and not process"``
    is then the quick subset without anyone remembering to mark a new user."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.process)
        if used & COMPILE_FIXTURES:
            item.add_marker(pytest.mark.compile)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Collect the garbage before a worker reports that it finished: pytest-xdist sends a
    worker still busy 5 s later a SIGINT, and pytest's own last collection of a heap that
    holds torch, transformers and dynamo can take seconds on a slow machine."""
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_phase():
    """Every test starts in EAGER with no capture window, whatever the last one did."""
    phase.reset()
    yield
    phase.reset()


@pytest.fixture(scope="session")
def fresh_interpreter() -> dict[str, Any]:
    """What one fresh interpreter saw (``tests/fresh_interpreter.py``): the import-time
    rules and the ``python -m`` commands share it, so the suite starts one, not six."""
    from tests.fresh_interpreter import run_probe

    return run_probe()
