"""The README's quick start, verbatim, on the GPU (it asserts graph == eager itself)."""

from __future__ import annotations

import pytest

from tests.readme_blocks import quick_start

pytestmark = pytest.mark.gpu


def test_quick_start_runs_verbatim() -> None:
    scope: dict[str, object] = {"__name__": "readme_quick_start"}
    exec(compile(quick_start(), "README.md:quick-start", "exec"), scope)
    assert scope["report"].captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]
