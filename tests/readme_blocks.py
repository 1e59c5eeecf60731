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


def _first_python_block(heading: str) -> str:
    """The first ```python block under the ``## heading`` of README.md."""
    text = README.read_text()
    assert f"\n## {heading}\n" in text, f"README.md: no '## {heading}' section"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"README.md: no python block under '## {heading}'"
    return match.group(1)


def quick_start() -> str:
    """The quick start: runs as written on a CPU (RecordingBackend) and on a GPU."""
    return _first_python_block("Quick start")


def hf_snippet() -> str:
    """The Hugging Face snippet: runs as written once the transformers extra is installed."""
    return _first_python_block("Hugging Face transformers")


def run(code: str, name: str) -> dict[str, object]:
    """Execute a block in a fresh namespace and return it."""
    scope: dict[str, object] = {"__name__": name}
    exec(compile(code, name, "exec"), scope)
    return scope


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    """Every relative link target of a Markdown file (outside code blocks), anchors dropped."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets
