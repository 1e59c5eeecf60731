from __future__ import annotations

import pytest

from graphguard import phase


@pytest.fixture(autouse=True)
def _fresh_phase():
    """Every test starts in EAGER with no capture window, whatever the last one did."""
    phase.reset()
    yield
    phase.reset()
