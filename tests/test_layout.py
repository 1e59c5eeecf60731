"""The package layout rule: the library ``graphguard`` never imports the reference
application ``graphguard_ref`` (models, TP shard, serving loop, demo, CLI).

Checked two ways: at run time (the suite's one fresh interpreter imports graphguard and
captures a GraphRunner and a PiecewiseRunner on the CPU, then lists what got loaded), and
statically (an AST scan of every library file's imports). Each check first proves on a
deliberate violation that it can fail.
"""

from __future__ import annotations

import ast
import textwrap
import warnings
from pathlib import Path

import pytest

from tests.fresh_interpreter import modules

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "graphguard"
REFERENCE = ROOT / "ref" / "src" / "graphguard_ref"
APP = "graphguard_ref"

# The run-time half reads the suite's one fresh interpreter (tests/fresh_interpreter.py):
# it imports graphguard, builds, captures and calls both runner kinds on the CPU
# (RecordingBackend), then builds a sanitizing runner, then imports a reference module.

LEFT_THE_LIBRARY = ("graphguard.models", "graphguard.engine", "graphguard.demo")
"""Where the reference application lived before ref/: none of it may come back."""


def test_probe_sees_a_reference_module_when_one_is_imported(fresh_interpreter) -> None:
    assert "graphguard_ref.serving_loop" in modules(fresh_interpreter["app_import"], APP)


def test_import_and_capture_of_both_runners_load_no_reference_application_module(
    fresh_interpreter,
) -> None:
    assert fresh_interpreter["pieces"] == 2
    assert fresh_interpreter["captured_sizes"] == [[1, 2, 4], [1, 2, 4]]
    for step in ("import", "capture", "sanitize"):
        assert modules(fresh_interpreter[step], APP, *LEFT_THE_LIBRARY) == [], step


def test_import_graphguard_loads_no_sanitizer_integration_or_transformers(
    fresh_interpreter,
) -> None:
    """The sanitizer loads when a runner asks for it, the Hugging Face integration when it
    is imported: a plain import, capture and replay load neither (nor ``transformers``)."""
    lazy = ("graphguard.sanitizer", "graphguard.integrations", "transformers")
    assert "graphguard.runner" in fresh_interpreter["import"]
    assert modules(fresh_interpreter["import"], *lazy) == []
    assert modules(fresh_interpreter["capture"], *lazy) == []
    assert "graphguard.sanitizer.checks" in fresh_interpreter["sanitize"]  # it can fail


def app_imports(source: str, filename: str = "<src>") -> list[str]:
    """``file:line module`` of every import of the reference application in ``source``.

    Catches ``import graphguard_ref...``, ``from graphguard_ref... import``, and
    ``importlib.import_module("graphguard_ref...")`` / ``__import__("graphguard_ref...")``.
    """
    hits: list[str] = []

    def is_app(name: str | None) -> bool:
        return name is not None and (name == APP or name.startswith(APP + "."))

    for node in ast.walk(ast.parse(source, filename)):
        names: list[str | None] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if fname in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                names = [str(arg.value)]
        hits += [f"{filename}:{node.lineno} {n}" for n in names if is_app(n)]
    return hits


@pytest.mark.parametrize(
    "source",
    [
        "import graphguard_ref",
        "import graphguard_ref.llama as llama",
        "from graphguard_ref.serving_loop import build_dispatcher",
        "def f():\n    from graphguard_ref import tp\n",
        "import importlib\nimportlib.import_module('graphguard_ref.demo')",
        "__import__('graphguard_ref')",
    ],
)
def test_scanner_finds_every_form_of_importing_the_application(source: str) -> None:
    assert app_imports(source)


def test_scanner_ignores_lookalikes() -> None:
    assert app_imports("import graphguard_refx\nfrom graphguard import runner\n") == []


def test_no_library_file_imports_the_reference_application() -> None:
    files = sorted(LIBRARY.rglob("*.py"))
    assert files, f"no library files under {LIBRARY}"
    hits = [h for f in files for h in app_imports(f.read_text(), str(f.relative_to(ROOT)))]
    assert hits == []


def test_the_reference_application_is_not_inside_the_library() -> None:
    assert not (LIBRARY / "models").exists()
    for name in ("engine.py", "demo.py", "demo", "llama"):
        assert not (LIBRARY / name).exists(), name
    assert not (LIBRARY.parent / APP).exists(), "the reference app lives in ref/ (graphguard-ref)"


WARN_LINES = 500
"""Above this a file is worth a look (a warning): is it still one idea?"""
FAIL_LINES = 800
"""Above this a file fails the layout: split it along its ideas, not at a line count."""


def _check_file_sizes(root: Path) -> None:
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in root.rglob("*.py")}
    assert sizes, f"no files under {root}"
    long = {f: n for f, n in sizes.items() if n > WARN_LINES}
    if long:
        warnings.warn(f"files over {WARN_LINES} lines (still one idea each?): {long}", stacklevel=2)
    assert {f: n for f, n in long.items() if n > FAIL_LINES} == {}


def test_no_reference_application_file_is_over_800_lines() -> None:
    _check_file_sizes(REFERENCE)


# --------------------------------------------------------------------------- library shape


def test_no_library_file_is_over_800_lines() -> None:
    _check_file_sizes(LIBRARY)


MAX_FILE_LINES = 500
"""The most lines a library file has: above it, it holds more than one idea."""
MAX_FUNCTION_LINES = 80
"""The most lines a function or method has, ``def`` to its last line (docstring
included, decorators not): a longer one is named steps waiting to be extracted."""


def oversized(source: str, filename: str = "<src>") -> list[str]:
    """``file: N lines`` when ``source`` is over :data:`MAX_FILE_LINES`, and
    ``file:line name: N lines`` for each function or method (nested ones too) over
    :data:`MAX_FUNCTION_LINES`."""
    hits = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        hits.append(f"{filename}: {lines} lines")
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                hits.append(f"{filename}:{node.lineno} {node.name}: {length} lines")
    return hits


def _function(lines: int, indent: str = "") -> str:
    """Source of a function ``lines`` long, its ``def`` line included."""
    body = "".join(f"{indent}    x = {i}\n" for i in range(lines - 1))
    return f"{indent}def f():\n{body}"


def test_size_finder_sees_a_long_file_and_a_long_method() -> None:
    method = "class C:\n    @property\n" + _function(MAX_FUNCTION_LINES + 1, "    ")
    assert oversized(method) == [f"<src>:3 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert oversized(_function(MAX_FUNCTION_LINES)) == []
    assert oversized("pass\n" * (MAX_FILE_LINES + 1)) == [f"<src>: {MAX_FILE_LINES + 1} lines"]
    assert oversized("pass\n" * MAX_FILE_LINES) == []


def test_no_library_file_is_over_500_lines_nor_any_function_over_80() -> None:
    files = sorted(LIBRARY.rglob("*.py"))
    assert files
    hits = [h for f in files for h in oversized(f.read_text(), str(f.relative_to(ROOT)))]
    assert hits == [], "\n".join(hits)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _import_time_statements(body: list[ast.stmt], functions: bool = False) -> list[ast.stmt]:
    """Statements that run when the module is imported: the body, branches of top-level
    ``if``/``try``/``with`` and class bodies; not ``if TYPE_CHECKING:``. With
    ``functions``, the bodies of functions and methods too: an import there is a
    dependency at run time, which a cycle through it makes as real as one at import."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if functions:
                out += _import_time_statements(node.body, functions)
            continue
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
            if name != "TYPE_CHECKING" or functions:  # a type-only import ties files too
                out += _import_time_statements(node.body, functions)
            out += _import_time_statements(node.orelse, functions)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                out += _import_time_statements(block, functions)
            for handler in node.handlers:
                out += _import_time_statements(handler.body, functions)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            out += _import_time_statements(node.body, functions)
        else:
            out.append(node)
    return out


def imported_names(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> set[str]:
    """The modules one import statement names (a relative one resolved against
    ``package``; ``from pkg import sub`` names ``pkg.sub`` when that is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}


def module_imports(
    source: str, module: str, is_package: bool, known: set[str], functions: bool = False
) -> set[str]:
    """The modules of ``known`` that ``module`` imports at import time (with
    ``functions``: at any time; explicit imports: ``from pkg import sub`` counts
    ``pkg.sub`` when it is a module, else ``pkg``)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_time_statements(ast.parse(source).body, functions):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported_names(node, package, known)
    return {m for m in found if m in known and m != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def library_import_graph(functions: bool = False) -> dict[str, set[str]]:
    root = LIBRARY.parent
    files = {_module_name(f, root): f for f in LIBRARY.rglob("*.py")}
    known = set(files)
    return {
        name: module_imports(f.read_text(), name, f.name == "__init__.py", known, functions)
        for name, f in files.items()
    }


def test_cycle_finder_sees_a_cycle_and_ignores_imports_inside_functions() -> None:
    known = {"p", "p.a", "p.b", "p.c"}
    lazy = {
        "p.a": module_imports("from p import b\n", "p.a", False, known),
        "p.b": module_imports("def f():\n    from p import a\n", "p.b", False, known),
    }
    assert lazy == {"p.a": {"p.b"}, "p.b": set()} and find_cycle(lazy) is None
    eager = {
        "p.a": module_imports("from . import b\n", "p.a", False, known),
        "p.b": module_imports("import p.c\n", "p.b", False, known),
        "p.c": module_imports(
            "try:\n    from .a import x\nexcept ImportError:\n    pass\n", "p.c", False, known
        ),
    }
    assert find_cycle(eager) == ["p.a", "p.b", "p.c", "p.a"]
    typing_only = module_imports(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n",
        "p.b",
        False,
        known,
    )
    assert typing_only == set()


def test_library_import_graph_has_no_cycle_at_import_time() -> None:
    graph = library_import_graph()
    assert "graphguard.runner" in graph and "graphguard.ladder" in graph["graphguard.runner"]
    assert find_cycle(graph) is None


def test_cycle_finder_counts_imports_inside_functions_when_asked() -> None:
    known = {"p", "p.a", "p.b"}
    lazy = {
        "p.a": module_imports("from p import b\n", "p.a", False, known, functions=True),
        "p.b": module_imports(
            "class R:\n    def f(self):\n        from p.a import x\n", "p.b", False, known, True
        ),
    }
    assert find_cycle(lazy) == ["p.a", "p.b", "p.a"]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n"
    assert module_imports(typed, "p.b", False, known, functions=True) == {"p.a"}


def test_library_has_no_cycle_at_run_time_either() -> None:
    """A function-level import is a run-time dependency: the runner loads the sanitizer
    where it builds its parts, so the sanitizer must never import the runner back. Type-only
    imports (``if TYPE_CHECKING:``) count here too: they tie the files for every reader."""
    graph = library_import_graph(functions=True)
    assert "graphguard.sanitizer.checks" in graph["graphguard.ladder.ladder"]
    assert find_cycle(graph) is None


def registrations(source: str) -> list[str]:
    """Module-level ``Imported.attr = value``: a module wiring itself into another at
    import (the dependency then runs backwards, invisible to an import scan)."""
    tree = ast.parse(source)
    imported = {
        (a.asname or a.name).split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in node.names
    }
    hits = []
    for node in _import_time_statements(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id in imported
            ):
                hits.append(f"{node.lineno}: {t.value.id}.{t.attr}")
    return hits


def test_registration_finder_sees_one() -> None:
    assert registrations("from graphguard.runner import GraphRunner\nGraphRunner._x = 1\n")
    assert registrations("import os\nx = 1\ndef f():\n    os.environ = {}\n") == []


def test_no_library_module_registers_itself_into_another() -> None:
    hits = {
        str(f.relative_to(ROOT)): registrations(f.read_text())
        for f in LIBRARY.rglob("*.py")
        if registrations(f.read_text())
    }
    assert hits == {}


# ------------------------------------------------------------------ the serving wing's door
#
# Modules meet through public names: lazy capture, the canary, weight updates and stats use
# the ladder's documented door, never its private attributes; and no two modules import
# each other, whichever way the import is written.

TORCH_PRIVATES = {
    "_cdata": "torch.Tensor / Storage: the C handle, read to identify a storage",
    "_schema": "torch OpOverload: the operator's schema",
    "_qualified_op_name": "torch custom op: the op's 'ns::name'",
}
"""Private attributes of torch objects that graphguard reads and also happens to define:
not a reach into graphguard (each with why graphguard reads it)."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_modules(package: Path) -> dict[str, ast.Module]:
    """``dotted name -> parsed source`` of every module under ``package`` (a directory)."""
    return {
        _module_name(f, package.parent): ast.parse(f.read_text(), str(f))
        for f in sorted(package.rglob("*.py"))
    }


def _defined_privates(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, methods, classes, module and class
    attributes, and ``self._x``/``cls._x`` assignments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id in ("self", "cls")
                ):
                    names.add(leaf.attr)
    return {n for n in names if _private(n)}


def _is_own(obj: ast.expr) -> bool:
    """``self``, ``cls``, ``super()`` or ``type(self)``: the object's own attributes."""
    if isinstance(obj, ast.Name):
        return obj.id in ("self", "cls")
    if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name):
        return obj.func.id == "super" or (
            obj.func.id == "type" and len(obj.args) == 1 and _is_own(obj.args[0])
        )
    return False


def private_reaches(package: Path) -> list[str]:
    """``module:line what`` for every reach into another module's private names: an
    attribute ``obj._x`` (``obj`` not self/cls/super()) where ``_x`` is defined by another
    module of ``package`` and not by this one, and ``from <package module> import _x`` of a
    private name (not a module) from another module."""
    trees = _package_modules(package)
    defined = {name: _defined_privates(tree) for name, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for module, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(module)
    top = package.name
    packages = _packages(trees)
    hits: list[str] = []
    for module, tree in trees.items():
        foreign = _foreign_names(tree, top)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr in TORCH_PRIVATES or node.attr in defined[module]:
                    continue
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in foreign:
                    continue  # torch._C, torch._dynamo.config, ...: not graphguard's
                others = owners.get(node.attr, set()) - {module}
                if others and not _is_own(node.value):
                    hits.append(
                        f"{module}:{node.lineno} {ast.unparse(node)} "
                        f"(defined in {', '.join(sorted(others))})"
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package_of = module if module in packages else module.rpartition(".")[0]
                    anchor = package_of.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                if base.split(".")[0] != top or base == module:
                    continue
                for alias in node.names:
                    if _private(alias.name) and f"{base}.{alias.name}" not in trees:
                        hits.append(f"{module}:{node.lineno} from {base} import {alias.name}")
    return sorted(hits, key=_by_place)


def _foreign_names(tree: ast.Module, top: str) -> set[str]:
    """Names a module binds to other packages' modules (``import torch``,
    ``from torch import _C``): attribute paths from them are not the package's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] != top
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] != top
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


def _by_place(hit: str) -> tuple[str, int, str]:
    place, _, what = hit.partition(" ")
    module, _, line = place.rpartition(":")
    return module, int(line), what


def _packages(trees: dict[str, ast.Module]) -> set[str]:
    """The names in ``trees`` that are packages (some other module lives inside them)."""
    return {m for m in trees if any(o.startswith(m + ".") for o in trees)}


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / next(iter(files)).split("/")[0]


def test_private_reach_finder_flags_reaches_and_spares_own_and_inherited_use(
    tmp_path: Path,
) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_shared.py": "_C = 1\n\ndef helper():\n    return 1\n",
            "pkg/ladder.py": """
                class Ladder:
                    _table = {}

                    def __init__(self):
                        self._entries = []

                    def _drop(self, n):
                        self._entries.remove(n)

                def _build():
                    return Ladder()
            """,
            "pkg/lazy.py": """
                import torch
                from pkg import _shared
                from pkg.ladder import Ladder, _build

                class Lazy(Ladder):
                    def __init__(self, ladder):
                        super().__init__()
                        self._ladder = ladder
                        self._mine = 0

                    def miss(self, n, tensor):
                        self._drop(n)
                        super()._drop(n)
                        type(self)._table.clear()
                        self._ladder._drop(n)
                        self._ladder._mine = tensor._cdata + torch._C._get_tracing_state()
                        return len(self._ladder._entries), Ladder._table, _shared.helper()
            """,
        },
    )
    assert private_reaches(pkg) == [
        "pkg.lazy:4 from pkg.ladder import _build",
        "pkg.lazy:16 self._ladder._drop (defined in pkg.ladder)",
        "pkg.lazy:18 Ladder._table (defined in pkg.ladder)",
        "pkg.lazy:18 self._ladder._entries (defined in pkg.ladder)",
    ]


def test_no_library_module_reaches_into_another_modules_privates() -> None:
    hits = private_reaches(LIBRARY)
    assert hits == [], "\n".join(hits)


def every_import(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere: at the top, inside
    functions and methods (also async ones), under ``if TYPE_CHECKING:``, in any block, and
    through ``importlib.import_module("...")`` with a constant name."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported_names(node, package, known)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__"):
                found.add(str(node.args[0].value))
    return {m for m in found if m in known and m != module}


def every_import_graph(package: Path) -> dict[str, set[str]]:
    trees = _package_modules(package)
    packages = _packages(trees)
    known = set(trees)
    return {name: every_import(tree, name, name in packages, known) for name, tree in trees.items()}


@pytest.mark.parametrize(
    "back",
    [
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "class B:\n    async def f(self):\n        with open('x'):\n            from . import a\n",
        "import importlib\ndef f():\n    return importlib.import_module('pkg.a')\n",
        "def f(x):\n    match x:\n        case 1:\n            import pkg.a\n",
    ],
    ids=["type-checking", "async-method-in-with", "import-module", "match-case"],
)
def test_every_import_cycle_finder_sees_each_way_of_importing_back(
    tmp_path: Path, back: str
) -> None:
    files = {"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n", "pkg/b.py": back}
    graph = every_import_graph(_write_package(tmp_path, files))
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    files["pkg/b.py"] = "import pkg\nimport pkg_a\n"  # the package itself, a lookalike
    assert find_cycle(every_import_graph(_write_package(tmp_path, files))) is None


def test_library_has_no_import_cycle_counting_every_import() -> None:
    graph = every_import_graph(LIBRARY)
    assert "graphguard.sanitizer.checks" in graph["graphguard.ladder.ladder"]  # function-local
    assert find_cycle(graph) is None


# ------------------------------------------------------------------ the runner composes
#
# A runner is composed of parts (graphguard.ladder): each file owns the state it sets. A
# private name one file sets and another reads through ``self`` is the inheritance chain
# of one class spread over files; what is left of it is the kind hooks and the replay
# path reading the store the ladder built.

SELF_REACH_LIMIT = 2
"""Cross-file private reaches through ``self`` the library may have (91 in 0.3, 28 in 0.4):
the public runners' one handle each on the ladder's capture half."""


def _assigned_privates(tree: ast.Module) -> set[str]:
    """Private names a module *defines*: functions, methods, classes, and assignments with
    a value (a bare class annotation, ``_x: int``, declares what another file sets and is
    not a definition)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign) or (
            isinstance(node, ast.AnnAssign) and node.value is not None
        ):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id in ("self", "cls")
                ):
                    names.add(leaf.attr)
    return {n for n in names if _private(n)}


def self_reaches(package: Path) -> list[str]:
    """``module:line name`` for every ``self._x``/``cls._x`` in a module that does not
    define ``_x`` (:func:`_assigned_privates`) when another module of ``package`` does."""
    trees = _package_modules(package)
    defined = {name: _assigned_privates(tree) for name, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for module, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(module)
    hits = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and node.attr not in defined[module]
                and owners.get(node.attr, set()) - {module}
            ):
                hits.append(f"{module}:{node.lineno} self.{node.attr}")
    return sorted(hits, key=_by_place)


def test_self_reach_finder_counts_bare_annotations_as_no_definition(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/base.py": """
                class Base:
                    _store: object

                    def call(self):
                        return self._store, self._mine

                    def _mine(self):
                        return 1
            """,
            "pkg/ladder.py": """
                from pkg.base import Base

                class Ladder(Base):
                    def __init__(self):
                        self._store = object()

                    def go(self):
                        return self._store, self._mine()
            """,
        },
    )
    assert self_reaches(pkg) == ["pkg.base:6 self._store", "pkg.ladder:9 self._mine"]


def test_private_state_reached_through_self_across_files_stays_under_the_limit() -> None:
    hits = self_reaches(LIBRARY)
    assert len(hits) <= SELF_REACH_LIMIT, "\n".join(hits)


# ------------------------------------------------------------------ the runner's parts
# The runner kind and the miss policy are parts handed to one concrete ladder: no base
# class leaves a method for a subclass to fill in, the door stays narrow, and every fact
# of the store and its records is written by the store alone.


def _is_protocol(node: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1].startswith("Protocol") for b in node.bases)


def _placeholder(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """What makes ``fn`` a stub: it raises NotImplementedError, or does nothing but return
    a constant (None, False, ``(False, None)``, an empty container) or pass."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1:
        return None
    (stmt,) = body
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        if ast.unparse(exc) == "NotImplementedError":
            return "raises NotImplementedError"
    if isinstance(stmt, ast.Pass):
        return "passes"
    if isinstance(stmt, ast.Return):
        value = stmt.value
        shown = ast.unparse(value) if value is not None else "None"
        try:
            constant = value is None or ast.literal_eval(value) in (None, False, (), [], {})
        except ValueError:
            constant = False
        if constant or shown == "(False, None)":
            return f"returns {shown}"
    return None


def stubs(package: Path) -> list[str]:
    """``module:Class.method why`` for each method of a class of ``package`` that raises
    NotImplementedError (anywhere), or is a placeholder (:func:`_placeholder`) that a
    subclass in ``package`` overrides: behaviour left for a subclass to fill in."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for module, tree in _package_modules(package).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not _is_protocol(node):
                classes[node.name] = (module, node)
    overridden: dict[str, set[str]] = {}  # base class name -> methods a subclass defines
    for _, node in classes.values():
        mine = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        for base in node.bases:
            overridden.setdefault(ast.unparse(base).split(".")[-1], set()).update(mine)
    hits = []
    for name, (module, node) in classes.items():
        for fn in node.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            why = _placeholder(fn)
            if why == "raises NotImplementedError" or (
                why is not None and fn.name in overridden.get(name, set())
            ):
                hits.append(f"{module}:{name}.{fn.name} {why}")
    return sorted(hits)


def test_stub_finder_sees_each_kind_and_spares_a_protocol_and_a_leaf(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/base.py": """
                from typing import Protocol

                class Kind(Protocol):
                    def run(self): ...

                class Base:
                    def run(self):
                        raise NotImplementedError

                    def lazy(self, n):
                        "No, unless a subclass says so."
                        return False, None

                    def real(self):
                        return 1

                class Leaf:
                    def answer(self):
                        return None
            """,
            "pkg/sub.py": """
                from pkg.base import Base

                class Sub(Base):
                    def lazy(self, n):
                        return True, n

                    def real(self):
                        return 2
            """,
        },
    )
    assert stubs(pkg) == [
        "pkg.base:Base.lazy returns (False, None)",
        "pkg.base:Base.run raises NotImplementedError",
    ]


KNOWN_HOOKS = {
    "graphguard.walk:Walker.special returns False": "the tensor walk's claim hook, which "
    "walk.py's and sanitizer/names.py's walkers fill in (to become a claim passed in)",
}
"""Placeholders a subclass fills in, still to become parts, each with what it is."""


def test_no_library_class_leaves_a_method_for_a_subclass_to_fill_in() -> None:
    """The runner kind (``ladder/kind.py``) and the miss policy (``ladder/miss.py``) are
    parts: a batch that misses a graph goes from ``__call__`` to the code that decides."""
    assert set(stubs(LIBRARY)) <= set(KNOWN_HOOKS), stubs(LIBRARY)


DOOR_LIMIT = 25
"""Members of :class:`graphguard.serving.Door`: the operations the canary, lazy capture
and the weights use (35 in 0.4)."""


def test_the_door_stays_narrow() -> None:
    tree = ast.parse((LIBRARY / "serving.py").read_text())
    (door,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Door"]
    members = [n for n in door.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))]
    assert len(members) <= DOOR_LIMIT, [ast.unparse(m).split("\n")[0] for m in members]


def test_the_door_is_built_from_parts_not_from_the_runners_private_methods() -> None:
    assert "class Floor" not in (LIBRARY / "ladder" / "door.py").read_text()
    tree = ast.parse((LIBRARY / "ladder" / "ladder.py").read_text())
    (call,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "LadderDoor"
    ]
    handed = [ast.unparse(v) for v in [*call.args, *(k.value for k in call.keywords)]]
    assert [h for h in handed if h.startswith("self._") and h[6] != "_"] == [
        "self._capturer",
        "self._check_weights",
    ], handed


STORE_FLAGS = ("serving", "released", "dirty", "pool", "refusals", "records", "evicted")
"""What :class:`~graphguard.ladder.store.GraphStore` knows of its graphs: written by it."""
RECORD_FIELDS = tuple(
    node.target.id
    for cls in ast.parse((LIBRARY / "ladder" / "record.py").read_text()).body
    if isinstance(cls, ast.ClassDef) and cls.name == "GraphRecord"
    for node in cls.body
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
)
"""The fields of :class:`~graphguard.ladder.record.GraphRecord`."""
MUTATORS = ("clear", "pop", "popitem", "update", "setdefault", "add", "discard", "remove")
HOT_PATH_DIRTY = "ladder/replay.py"
"""The replay path marks the rows it filled inline (``store.dirty = e.n``): a store method
there would cost a frame on every replay."""
KNOWN_RECORD_WRITERS = {
    "provenance.py": "Provenance.resolve moves a record's pending reads into its reads",
}
"""Record writes outside the store still to move into it, each with what it does."""


def fact_writes(source: str, filename: str) -> list[str]:
    """``file:line target`` for each write of a store flag through a name that holds a
    store (``store``, ``self._store``, ``parts.store``) (an assignment, an item assignment
    or deletion, a mutating call), and of a record field through a name that holds a
    record (``rec``, ``record``, ``*_rec``)."""
    hits: list[str] = []

    def check(target: ast.expr, lineno: int) -> None:
        while isinstance(target, ast.Subscript):
            target = target.value
        if not isinstance(target, ast.Attribute):
            return
        owner, attr = target.value, target.attr
        name = owner.id if isinstance(owner, ast.Name) else ""
        if attr in STORE_FLAGS and ast.unparse(owner).endswith("store"):
            if not (attr == "dirty" and filename.endswith(HOT_PATH_DIRTY)):
                hits.append(f"{filename}:{lineno} {ast.unparse(target)}")
        elif attr in RECORD_FIELDS and (name in ("rec", "record") or name.endswith("_rec")):
            hits.append(f"{filename}:{lineno} {ast.unparse(target)}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for leaf in t.elts if isinstance(t, ast.Tuple) else [t]:
                    check(leaf, node.lineno)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check(node.target, node.lineno)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                check(t, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            check(node.func.value, node.lineno)
    return hits


@pytest.mark.parametrize(
    "source",
    [
        "def f(store):\n    store.serving = True\n",
        "def f(self):\n    self._store.released = False\n",
        "def f(store):\n    store.refusals.clear()\n",
        "def f(store, s):\n    store.refusals[s] = ('failed', '')\n",
        "def f(rec):\n    rec.unread = True\n",
        "def f(rec, k):\n    del rec.pending[k]\n",
    ],
)
def test_fact_write_finder_sees_each_kind(source: str) -> None:
    assert fact_writes(source, "x.py")


def test_fact_write_finder_spares_own_state_and_the_hot_path() -> None:
    assert fact_writes("def f(self):\n    self.serving = True\n", "x.py") == []
    assert fact_writes("def f(session):\n    session.pool = 1\n", "x.py") == []
    assert fact_writes("def f(store, e):\n    store.dirty = e.n\n", "ladder/replay.py") == []


def test_every_fact_of_the_store_and_its_records_is_written_by_the_store() -> None:
    hits = [
        h
        for f in sorted(LIBRARY.rglob("*.py"))
        if f.relative_to(LIBRARY).as_posix() != "ladder/store.py"
        for h in fact_writes(f.read_text(), f.relative_to(LIBRARY).as_posix())
    ]
    assert {h.split(":")[0] for h in hits} <= set(KNOWN_RECORD_WRITERS), "\n".join(hits)


CAPTURE_PATH = (
    "capture.py",
    "backend.py",
    "captured.py",
    "recording.py",
    "_graph_args.py",
    "lazy.py",
    "ladder",
    "piecewise",
)
"""The files data crosses on its way through a capture (the lifecycle, the backends, the
runner's parts, the lazy capture)."""


def side_channels(source: str, filename: str = "<src>") -> list[str]:
    """``file:line what`` for each side channel in ``source``: a ``threading.local()`` or a
    ``contextvars.ContextVar`` (data beside the call instead of through it), a ``setattr``
    on an object the function did not make (an attribute set on a torch graph), and a
    ``getattr`` probe of a backend member the protocol does not declare."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("local", "ContextVar"):
            hits.append(f"{filename}:{node.lineno} {name}()")
        elif name == "setattr" and node.args and isinstance(node.args[0], ast.Name):
            if node.args[0].id in ("graph", "g", "cuda_graph"):
                hits.append(f"{filename}:{node.lineno} setattr({node.args[0].id}, ...)")
        elif name == "getattr" and node.args:
            target = ast.unparse(node.args[0])
            if "backend" in target:
                hits.append(f"{filename}:{node.lineno} getattr({target}, ...)")
    return hits


@pytest.mark.parametrize(
    "source",
    [
        "import threading\n_local = threading.local()\n",
        "import contextvars\n_on = contextvars.ContextVar('on')\n",
        "def attach(graph, args):\n    setattr(graph, 'graphguard_args', args)\n",
        "def probe(backend):\n    return getattr(backend, 'reads_graphs', None)\n",
        "def probe(self):\n    return getattr(self.backend, 'capture_runs_body', True)\n",
    ],
    ids=["thread-local", "context-var", "setattr-graph", "getattr-backend", "getattr-self-backend"],
)
def test_side_channel_finder_sees_each_kind(source: str) -> None:
    assert side_channels(source)


def test_nothing_crosses_the_capture_path_beside_the_calls() -> None:
    """What a capture read comes back in its return value (``Captured``), provenance's
    switch and the sync guard go in as plan fields, and the backend protocol declares every
    member graphguard reads."""
    files = [
        f
        for part in CAPTURE_PATH
        for f in (
            [LIBRARY / part] if part.endswith(".py") else sorted((LIBRARY / part).rglob("*.py"))
        )
    ]
    hits = [h for f in files for h in side_channels(f.read_text(), str(f.relative_to(ROOT)))]
    assert hits == []


def test_the_door_is_not_the_runners_public_face() -> None:
    import torch

    import graphguard as gg
    from graphguard.serving import Door

    for name in (
        "capture_sizes",
        "drop_size",
        "rebuild_entries",
        "replay_entry",
        "replay_detached",
        "entries",
        "pad_table",
        "narrows",
        "exclusive",
        "prove_graph",
    ):
        assert not hasattr(gg.GraphRunner, name), name
        assert not hasattr(gg.PiecewiseRunner, name), name
    r = gg.GraphRunner(
        torch.nn.Linear(4, 4), (torch.zeros(1, 4),), sizes=[1, 2],
        backend=gg.RecordingBackend(), progress=False,
    )  # fmt: skip
    assert isinstance(r.door, Door)
    for name in ("capture_sizes", "drop_size", "refuse", "replay_entry", "check_weights"):
        assert callable(getattr(r.door, name)), name


@pytest.mark.parametrize("kind", ["GraphRunner", "PiecewiseRunner"])
def test_a_member_moved_to_the_door_in_0_4_names_its_new_home(kind: str) -> None:
    """Every 0.4 move (CHANGELOG 0.4: the door; what 0.3's runners had that 0.4's lack)
    raises an AttributeError naming where it went, not Python's "did you mean
    'captured_sizes'?"; still not on the runner (hasattr False), nothing forwarded."""
    import torch

    import graphguard as gg
    from graphguard.errors import GraphGuardError, MovedAttributeError
    from graphguard.ladder.moved import MOVED_TO_DOOR, REMOVED

    moved_03 = {
        "capture_sizes", "derived_reads", "drop_size", "entries", "exclusive", "generators",
        "graph_keys", "graph_reads", "narrows", "pad_table", "prove_graph", "reads_by_graph",
        "rebuild_entries", "replay_detached", "replay_entry", "unpad", "weights",
        "ledger", "autocast_policy", "refuse", "recapture_moved",
    }  # fmt: skip
    assert moved_03 == set(MOVED_TO_DOOR) | set(REMOVED)
    lin = torch.nn.Linear(4, 4)
    ex = (torch.zeros(1, 4),)
    be = gg.RecordingBackend()
    r = (
        gg.GraphRunner(lin, ex, sizes=[1, 2], backend=be, progress=False)
        if kind == "GraphRunner"
        else gg.PiecewiseRunner(lin, ex, sizes=[1, 2], split_ops=[], backend=be, progress=False)
    )
    for name in sorted(moved_03):
        assert not hasattr(type(r), name) and not hasattr(r, name), name
        with pytest.raises(MovedAttributeError) as info:
            getattr(r, name)
        text = str(info.value)
        assert isinstance(info.value, AttributeError) and isinstance(info.value, GraphGuardError)
        assert text.startswith(f"{kind}.{name} ") and " in 0.4" in text, text
        if name in MOVED_TO_DOOR:
            assert f"moved to runner.door.{name} in 0.4" in text
            assert hasattr(r.door, name), name  # the new home exists
    with pytest.raises(AttributeError, match=r"moved to runner\.door\.capture_sizes in 0\.4"):
        r.capture_sizes([2], how="lazily")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError) as plain:
        r.captured_sizez  # type: ignore[attr-defined]  # noqa: B018
    assert type(plain.value) is AttributeError and plain.value.name == "captured_sizez"


# ------------------------------------------------------------ plain construction
#
# A runner call builds the class called, through its ``__init__`` alone: no metaclass
# checks the keywords, no ``__new__`` swaps the class, no class is made on the fly. The
# sanitizer is a part the runner holds, chosen in ``__init__``.

RUNNER_CLASSES = (
    ("graphguard.runner", "GraphRunner"),
    ("graphguard.piecewise.runner", "PiecewiseRunner"),
    ("graphguard.ladder.ladder", "Ladder"),
    ("graphguard.dispatch.dispatcher", "Dispatcher"),
    ("graphguard.distributed", "DistributedGraphRunner"),
    ("graphguard.integrations.transformers", "GraphedCausalLM"),
)


def construction_magic(source: str, filename: str = "<src>") -> list[str]:
    """``file:line what`` for each class statement with a ``metaclass=``, each ``__new__``
    defined, and each class made by a three-argument ``type(...)`` call in ``source``."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ClassDef) and any(k.arg == "metaclass" for k in node.keywords):
            hits.append(f"{filename}:{node.lineno} class {node.name}(metaclass=...)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__new__":
            hits.append(f"{filename}:{node.lineno} def __new__")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "type"
            and len(node.args) == 3
        ):
            hits.append(f"{filename}:{node.lineno} type(name, bases, namespace)")
    return hits


@pytest.mark.parametrize(
    "source",
    [
        "class A(metaclass=Checked):\n    pass\n",
        "class A:\n    def __new__(cls, *a, **k):\n        return super().__new__(cls)\n",
        "def mixed(cls):\n    return type('Mixed' + cls.__name__, (M, cls), {})\n",
    ],
    ids=["metaclass", "new", "class-on-the-fly"],
)
def test_construction_magic_finder_sees_each_kind(source: str) -> None:
    assert construction_magic(source)


def test_runner_modules_build_by_a_plain_init() -> None:
    """No metaclass, ``__new__`` or class made on the fly in any runner's module, nor in
    the sanitizer the runner holds."""
    modules = [m for m, _ in RUNNER_CLASSES]
    files = [LIBRARY.parent / (m.replace(".", "/") + ".py") for m in modules]
    files += sorted((LIBRARY / "sanitizer").rglob("*.py"))
    hits = [h for f in files for h in construction_magic(f.read_text(), f.name)]
    assert hits == []


def test_no_runner_class_has_a_metaclass_or_a_new() -> None:
    """Checked on the classes themselves, every base included (``object`` aside)."""
    import importlib

    pytest.importorskip("transformers")
    for module, name in RUNNER_CLASSES:
        cls = getattr(importlib.import_module(module), name)
        for klass in cls.__mro__:
            assert type(klass) is type, f"{name}: {klass.__name__} has metaclass {type(klass)}"
            assert klass is object or "__new__" not in vars(klass), f"{name}: {klass.__name__}"


def test_a_sanitized_runner_is_the_class_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sanitize=True`` (or the environment switch) adds a part, not a subclass: the
    runner is a ``GraphRunner`` (a user's subclass stays itself), and a plain runner's
    replay path is the class's own method."""
    import torch

    import graphguard as gg

    monkeypatch.delenv("GRAPHGUARD_SANITIZE", raising=False)

    def build(cls: type[gg.GraphRunner], **kw: object) -> gg.GraphRunner:
        return cls(
            torch.nn.Linear(4, 4), (torch.zeros(1, 4),), sizes=[1, 2],
            backend=gg.RecordingBackend(), progress=False, **kw,
        )  # fmt: skip

    class Mine(gg.GraphRunner):
        pass

    on = build(gg.GraphRunner, sanitize=True)
    assert type(on) is gg.GraphRunner and isinstance(on, gg.GraphRunner) and on.sanitize
    assert type(build(Mine, sanitize=True)) is Mine
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", "1")
    assert type(build(gg.GraphRunner)) is gg.GraphRunner
    monkeypatch.delenv("GRAPHGUARD_SANITIZE")
    off = build(gg.GraphRunner)
    assert not off.sanitize and off._run == off._graph_kind.run  # the kind's own, unwrapped
    assert on._run != on._graph_kind.run  # inside the sanitizer's checks
