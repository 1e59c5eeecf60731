"""Every block of the README and docs/ marked runnable runs as written, on the CPU (the GPU
runs the README's quick start and the Hugging Face example with the README's three lines in
tests/gpu/test_readme_gpu.py), and every claim in the prose that a block runs as written
points at a marked block. The mark: ``<!-- runnable -->`` on the line above the block's fence
(tests/readme_blocks.py)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

import graphguard
from tests.readme_blocks import DOCS, MARK, ROOT, Snippet, hf_lines, run, runnable, snippets

CLAIM = re.compile(r"runs as written|a runnable example|run this block verbatim", re.I)
"""Prose that promises the next block of its section runs."""

# Identical blocks run once.
BLOCKS: dict[str, list[Snippet]] = {}
for _s in runnable():
    BLOCKS.setdefault(_s.code, []).append(_s)


def _ids(code: str) -> str:
    return "+".join(s.name for s in BLOCKS[code])


def _captured_ladder(scope: dict[str, object]) -> None:
    assert scope["report"].captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]


def _two_prompts_eight_tokens(scope: dict[str, object]) -> None:
    assert scope["out"].shape == (2, 5 + 8)  # type: ignore[attr-defined]


def _the_readme_lines_return_what_hf_returns(scope: dict[str, object]) -> None:
    """The README's three Hugging Face lines, run on the model and prompts the guide's whole
    example leaves, return what HF's own generate returned there. On a CPU the README's
    ``GraphedCausalLM`` is handed ``RecordingBackend`` (a GPU runs them verbatim:
    tests/gpu/test_readme_gpu.py)."""
    _two_prompts_eight_tokens(scope)
    import graphguard.integrations.transformers as hf

    emulated = functools.partial(
        hf.GraphedCausalLM, backend=graphguard.RecordingBackend(), progress=False
    )
    on_cpu = scope["device"] != "cuda"
    with mock.patch.object(hf, "GraphedCausalLM", emulated) if on_cpu else contextlib.nullcontext():
        lines = run(hf_lines(), "README.md:hf_lines", scope)
    assert torch.equal(lines["out"], scope["ref"])  # type: ignore[arg-type]


AFTER: dict[str, Callable[[dict[str, object]], None]] = {
    "Quick start": _captured_ladder,
    "Hugging Face transformers: `GraphedCausalLM`": _the_readme_lines_return_what_hf_returns,
}
"""What a block's own asserts leave out, checked on the namespace it leaves (by section)."""


@pytest.mark.parametrize("code", list(BLOCKS), ids=[_ids(c) for c in BLOCKS])
def test_runnable_block_runs_as_written(code: str) -> None:
    if "import transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the .[transformers] extra)")
    first = BLOCKS[code][0]
    scope = run(code, first.name)  # each block asserts its own result (graph == eager)
    for s in BLOCKS[code]:
        if s.heading in AFTER:
            AFTER[s.heading](scope)


def test_the_cpu_examples_are_marked_runnable() -> None:
    names = {(s.page.name, s.heading) for s in runnable()}
    assert {
        ("README.md", "Quick start"),
        ("hf.md", "Hugging Face transformers: `GraphedCausalLM`"),
        ("weights.md", "Weight updates under live graphs"),
        ("hf-continuous.md", "Hugging Face continuous batching through graphguard"),
    } <= names


def _claims_without_a_marked_block(page: Path) -> list[int]:
    """The line of each claim whose section's next block is not marked runnable."""
    text = page.read_text()
    marked = {s.line for s in snippets(page)}
    fences = [m.start() for m in re.finditer(r"^```", text, re.M)]
    opening = fences[::2]  # fences alternate: open, close
    closing = fences[1::2]
    bad = []
    for m in CLAIM.finditer(text):
        if any(o < m.start() < c for o, c in zip(opening, closing)):
            continue  # inside a code block
        nxt = next((o for o in opening if o > m.start()), None)
        heading = re.search(r"^#+ ", text[m.start() : nxt], re.M) if nxt else None
        line = text.count("\n", 0, m.start()) + 1
        if nxt is None or heading is not None:
            continue  # no block follows in this section: a claim about another page
        if text.count("\n", 0, nxt) + 1 not in marked:
            bad.append(line)
    return bad


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_claimed_to_run_as_written_is_marked_runnable(page: Path) -> None:
    lines = _claims_without_a_marked_block(page)
    assert lines == [], f"{page.relative_to(ROOT)}: 'runs as written' at lines {lines}, no {MARK}"


def test_the_mark_and_the_claim_checks_can_fail(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# A\n\nThis runs as written:\n\n```python\nx = 1\n```\n\n"
        f"# B\n\n{MARK}\n```python\ny = 2\n```\n"
    )
    assert [s.code for s in snippets(doc)] == ["y = 2\n"]
    assert _claims_without_a_marked_block(doc) == [3]
    doc.write_text(f"{MARK}\n```bash\nls\n```\n")
    with pytest.raises(AssertionError, match="non-python block"):
        snippets(doc)
