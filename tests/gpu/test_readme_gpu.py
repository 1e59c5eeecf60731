"""The README's quick start, verbatim, on the GPU, and its three Hugging Face lines, verbatim,
on the model and prompts of docs/hf.md's whole example (itself run verbatim): each asserts
its graph result equals eager, or HF's own generate."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.readme_blocks import hf_example, hf_lines, quick_start, run

pytestmark = pytest.mark.gpu


def test_quick_start_runs_verbatim() -> None:
    scope = run(quick_start(), "quick_start")
    assert scope["device"] == "cuda"
    assert scope["report"].captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the .[transformers] extra)",
)
def test_hf_example_and_the_readme_lines_run_verbatim() -> None:
    scope = run(hf_example(), "hf_example")
    assert scope["device"] == "cuda"
    lines = run(hf_lines(), "hf_lines", scope)
    assert torch.equal(lines["out"], scope["ref"])  # type: ignore[arg-type]
