"""The README's code blocks, as tests read them: the quick start must run verbatim."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start() -> str:
    """The first ```python block under the '## Quick start' heading."""
    text = README.read_text()
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under '## Quick start'"
    return match.group(1)
