"""The field's reload bugs on the CPU (issue 40), each caught before the first replay
after the reload, naming the graphs, the tensor and the fix (tests/provenance_checks.py
``RELOAD_BUGS``; the same cases run on CUDA in tests/gpu/test_provenance_gpu.py)."""

from __future__ import annotations

import pytest

from tests import provenance_checks as P


@pytest.mark.parametrize("bug", list(P.RELOAD_BUGS))
def test_reload_bug_is_caught_before_the_first_replay(bug: str) -> None:
    P.reload_case(bug, "cpu")
