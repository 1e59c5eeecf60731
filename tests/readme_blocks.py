"""The README's and docs' code blocks and links, as the tests read them.

A block marked runnable (the line ``<!-- runnable -->`` right above its ```python fence)
runs as written, on a CPU and on a GPU: tests/test_snippets.py executes every one of them
verbatim, and a claim in the prose that a block runs as written needs the mark."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The pages whose blocks can be marked runnable."""

MARK = "<!-- runnable -->"


@dataclass(frozen=True)
class Snippet:
    """One runnable block: where it is (page, line of its fence, section) and its code."""

    page: Path
    line: int
    heading: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def snippets(page: Path) -> list[Snippet]:
    """The runnable blocks of ``page``, in order (a mark above a non-python block fails)."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() != MARK:
            continue
        line = text.count("\n", 0, m.start()) + 1
        assert m.group(1) == "python", f"{page.name}:{line}: {MARK} above a non-python block"
        headings = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        out.append(Snippet(page, line, headings[-1] if headings else "", m.group(2)))
    return out


def runnable() -> list[Snippet]:
    """Every runnable block of the README and docs/."""
    return [s for page in DOCS for s in snippets(page)]


REFERENCE = ROOT / "docs" / "reference.md"
"""The reference: every option, the semantics, failure semantics and every error."""

HF_GUIDE = ROOT / "docs" / "hf.md"
"""The Hugging Face guide, which holds the whole example the README's three lines come from."""


def _first_python_block(heading: str, page: Path = README) -> str:
    """The first ```python block under the ``## heading`` of ``page`` (README.md by default)."""
    text = page.read_text()
    assert f"\n## {heading}\n" in text, f"{page.name}: no '## {heading}' section"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"{page.name}: no python block under '## {heading}'"
    return match.group(1)


def quick_start() -> str:
    """The quick start: runs as written on a CPU (RecordingBackend) and on a GPU."""
    return _first_python_block("Quick start")


def hf_lines() -> str:
    """The README's Hugging Face lines: they run in the namespace the guide's example leaves
    (``model``, ``input_ids``, ``attention_mask``), verbatim on a GPU."""
    return _first_python_block("Hugging Face transformers")


def hf_example() -> str:
    """docs/hf.md's whole example: runs as written once the transformers extra is installed."""
    return snippets(HF_GUIDE)[0].code


def run(code: str, name: str, scope: dict[str, object] | None = None) -> dict[str, object]:
    """Execute a block in a fresh namespace (or a copy of ``scope``) and return it."""
    scope = {**(scope or {}), "__name__": name}
    exec(compile(code, name, "exec"), scope)
    return scope


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """A Markdown file's text outside its code blocks."""
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def relative_links(path: Path) -> list[str]:
    """Every relative link target of a Markdown file (outside code blocks), anchors dropped."""
    targets = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def anchored_links(path: Path) -> list[tuple[Path, str]]:
    """Each link of a Markdown file into a Markdown page's heading: (the page, the anchor)."""
    out = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        page, anchor = target.split("#", 1)
        if not page or page.endswith(".md"):
            out.append(((path.parent / page).resolve() if page else path, anchor))
    return out


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    made hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
