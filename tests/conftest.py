from __future__ import annotations

from typing import Any

import pytest

from graphguard import phase


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
