"""The README's quick start and Hugging Face snippet, verbatim, on the GPU (each asserts
its graph result equals eager, or HF's own generate, itself)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.readme_blocks import hf_snippet, quick_start, run

pytestmark = pytest.mark.gpu


def test_quick_start_runs_verbatim() -> None:
    scope = run(quick_start(), "quick_start")
    assert scope["device"] == "cuda"
    assert scope["report"].captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the .[transformers] extra)",
)
def test_hf_snippet_runs_verbatim() -> None:
    scope = run(hf_snippet(), "hf_snippet")
    assert scope["device"] == "cuda"
