"""CI step: mypy rejects each misspelt or mistyped runner keyword in
``.ci/typed_keywords.py`` on its own line, and accepts the correct calls beside them.

A step of ``.ci/run`` rather than a test: one mypy run over the library costs half a
minute, which the README's test command should not pay. Exit 0 when mypy's errors are
exactly the ones the file marks; otherwise 1, with what differed.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from mypy import api

CALLS = Path(__file__).with_name("typed_keywords.py")
MARK = re.compile(r"^# mypy rejects: (.+)$")


def expected(path: Path) -> dict[int, str]:
    """Line number -> the text its mypy error must contain (the line after each mark)."""
    lines = path.read_text().splitlines()
    return {i + 1: m.group(1).strip() for i, ln in enumerate(lines, 1) if (m := MARK.match(ln))}


def reported(out: str, path: Path) -> dict[int, list[str]]:
    """Line number -> mypy's error messages on that line of ``path``."""
    errors: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.match(rf"(?:.*/)?{re.escape(path.name)}:(\d+): error: (.*)$", line)
        if m:
            errors.setdefault(int(m.group(1)), []).append(m.group(2))
    return errors


def problems(want: dict[int, str], got: dict[int, list[str]]) -> list[str]:
    """Every difference between the marked errors and mypy's, one line each."""
    out = []
    for line, text in sorted(want.items()):
        msgs = got.get(line, [])
        if len(msgs) != 1 or text not in msgs[0]:
            out.append(f"line {line}: expected one error containing {text!r}, got {msgs}")
    for line in sorted(set(got) - set(want)):
        out.append(f"line {line}: unexpected error(s) {got[line]} (a correct call must pass)")
    return out


def main() -> int:
    want = expected(CALLS)
    if not want:
        print(f"{CALLS}: no '# mypy rejects:' marks: nothing would be checked")
        return 1
    with tempfile.TemporaryDirectory() as cache:
        out, err, _ = api.run([str(CALLS), "--strict", "--no-error-summary", "--cache-dir", cache])
    found = problems(want, reported(out, CALLS))
    if found or err.strip():
        print(f"{CALLS}: mypy's errors are not the marked ones:", *found, err, sep="\n  ")
        print(out)
        return 1
    print(f"typed keywords: mypy rejects the {len(want)} marked calls and accepts the rest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
