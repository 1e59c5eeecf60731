from __future__ import annotations

from typing import Any

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
