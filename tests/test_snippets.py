"""Every block of the README and docs/ marked runnable runs as written, on the CPU (the GPU
runs the README's two in tests/gpu/test_readme_gpu.py), and every claim in the prose that
a block runs as written points at a marked block. The mark: ``<!-- runnable -->`` on the
line above the block's fence (tests/readme_blocks.py)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.readme_blocks import DOCS, MARK, ROOT, Snippet, run, runnable, snippets

CLAIM = re.compile(r"runs as written|a runnable example|run this block verbatim", re.I)
"""Prose that promises the next block of its section runs."""

# Identical blocks (the README's Hugging Face example is also docs/hf.md's) run once.
BLOCKS: dict[str, list[Snippet]] = {}
for _s in runnable():
    BLOCKS.setdefault(_s.code, []).append(_s)


def _ids(code: str) -> str:
    return "+".join(s.name for s in BLOCKS[code])


def _captured_ladder(scope: dict[str, object]) -> None:
    assert scope["report"].captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]


def _two_prompts_eight_tokens(scope: dict[str, object]) -> None:
    assert scope["out"].shape == (2, 5 + 8)  # type: ignore[attr-defined]


AFTER: dict[str, Callable[[dict[str, object]], None]] = {
    "Quick start": _captured_ladder,
    "Hugging Face transformers": _two_prompts_eight_tokens,
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
        ("README.md", "Hugging Face transformers"),
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
