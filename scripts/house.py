"""The house in numbers: the measures issue 50 set limits on, for one checkout of the library.

Usage: ``python scripts/house.py [SRC_DIR ...]`` (default: this checkout's ``src``); with
several, one column each (e.g. an old tree from ``git archive REV src | tar -x -C /tmp/old``
beside today's). Uses the scanners of ``tests/test_layout.py``, so the numbers are the ones
the layout tests hold.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE / "tests"), str(HERE / "src")]
import test_layout as layout  # noqa: E402


def measure(src: Path) -> dict[str, object]:
    lib = src / "graphguard"
    layout.LIBRARY = lib
    files = sorted(lib.rglob("*.py"))
    lines = {f: f.read_text().count("\n") for f in files}
    long_fns = 0
    stubs = 0
    door = None
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                long_fns += (node.end_lineno or node.lineno) - node.lineno + 1 > 80
            if isinstance(node, ast.Raise) and node.exc is not None:
                e = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                stubs += isinstance(e, ast.Name) and e.id == "NotImplementedError"
            if isinstance(node, ast.ClassDef) and node.name == "Door":
                door = sum(isinstance(b, (ast.FunctionDef, ast.AnnAssign)) for b in node.body)
    graph = layout.library_import_graph()

    @functools.cache
    def floor(m: str) -> int:
        return 1 + max((floor(d) for d in graph[m] if d in graph and d != m), default=0)

    return {
        "files": len(files),
        "lines": sum(lines.values()),
        "files over 500 lines": sum(n > 500 for n in lines.values()),
        "largest file (lines)": max(lines.values()),
        "functions over 80 lines": long_fns,
        "NotImplementedError stubs": stubs,
        "Door protocol members": door,
        "cross-file self._x reaches": len(layout.self_reaches(lib)),
        "import floors (longest chain)": max(floor(m) for m in graph),
    }


def main() -> None:
    roots = [Path(a) for a in sys.argv[1:]] or [HERE / "src"]
    cols = [measure(r) for r in roots]
    print("| measure | " + " | ".join(str(r) for r in roots) + " |")
    print("| --- |" + " --- |" * len(roots))
    for key in cols[0]:
        print(f"| {key} | " + " | ".join(str(c[key]) for c in cols) + " |")


if __name__ == "__main__":
    main()
