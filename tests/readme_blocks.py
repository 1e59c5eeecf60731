"""The README's code blocks and links, as the tests read them: the executed blocks run verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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
    """Execute a README block in a fresh namespace and return it."""
    scope: dict[str, object] = {"__name__": name}
    exec(compile(code, f"README.md:{name}", "exec"), scope)
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
