"""Walking what a callable can reach: the one :class:`Walker` over user objects.

``reachable_tensors`` names the tensors (or generators) a step can reach as the user
would (``cache``, ``layers.0.k``); ``StateSet``, :mod:`graphguard.rng` and the
sanitizer's name table all walk with it, so the limits live in one place.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Mapping
from typing import Any

import torch

ATTR, ITEM = "attr", "item"
"""How a walked object was reached: ``vars(container)[key]`` or ``container[key]``."""
Slot = tuple[Any, Any, str]
"""``(container, key, kind)``: where a walked object was found (so it can be rebound)."""


MAX_DEPTH = 6
"""How deep a walk goes below its root (the walker's default and the declaration checks')."""


_LEAVES: frozenset[type] = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size}
)
"""Types that hold nothing to walk, turned away before any other test (a config's many
numbers and strings, a model's dtypes): no node of the budget, no ``Mapping`` test."""


class Walker:
    """Visits every object reachable from the roots it is given, each object once.

    Follows mappings (str/int keys), lists, tuples, ``functools.partial`` and plain
    object attributes; a module's tensors and attributes go through :meth:`module`, a
    tensor to :meth:`tensor`, and :meth:`special` may claim any other object first.
    Bounded three ways, all parameters, because the walk runs on user objects of any
    size: ``max_depth`` levels below a root, ``max_nodes`` objects opened (tensors are
    leaves and not counted), ``max_items`` entries of one container. One instance keeps
    its seen-set and budget across roots. A class, not a recursive closure: a closure
    that refers to itself is a reference cycle, and with the collector frozen during
    capture it would keep every tensor it saw alive.

    The default hooks collect ``(name, tensor)`` into :attr:`out` (module buffers, and
    parameters when ``params``): what :func:`reachable_tensors` and ``StateSet`` use;
    the sanitizer's name table (``sanitizer/names.py``) overrides them.
    """

    def __init__(
        self,
        *,
        params: bool = True,
        max_depth: int = MAX_DEPTH,
        max_nodes: int = 20_000,
        max_items: int = 4096,
        dedupe_tensors: bool = True,
    ) -> None:
        self.params = params
        self.max_depth = max_depth
        self.max_items = max_items
        self.dedupe_tensors = dedupe_tensors
        """False: a tensor reached twice is reported twice (each place it is bound)."""
        self.out: list[tuple[str, torch.Tensor]] = []
        self.seen: set[int] = set()
        self.budget = max_nodes

    skip: frozenset[type] = _LEAVES
    """Types turned away before a visit (no name built, no node of the budget); a walker
    for something other than tensors adds the tensor types."""

    def visit(self, x: Any, name: str, depth: int = 0, slot: Slot | None = None) -> None:
        if depth > self.max_depth or type(x) in self.skip:
            return
        if isinstance(x, torch.Tensor):
            if self.dedupe_tensors:
                if id(x) in self.seen:
                    return
                self.seen.add(id(x))
            self.tensor(x, name, slot)
            return
        if self.budget <= 0 or id(x) in self.seen:
            return
        self.budget -= 1
        self.seen.add(id(x))
        if self.special(x, name, depth):
            return
        if isinstance(x, torch.nn.Module):
            self.module(x, name, depth)
        elif type(x) is dict or isinstance(x, Mapping):
            for i, (k, v) in enumerate(x.items()):
                if i >= self.max_items:
                    break
                if isinstance(k, (str, int)) and type(v) not in self.skip:
                    self.visit(v, f"{name}[{k!r}]" if name else str(k), depth + 1, (x, k, ITEM))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x[: self.max_items]):
                if type(v) not in self.skip:
                    self.visit(
                        v, f"{name}[{i}]", depth + 1, (x, i, ITEM) if isinstance(x, list) else None
                    )
        elif isinstance(x, functools.partial):
            self.visit(x.func, name, depth + 1)
            self.visit(list(x.args), f"{name}.args", depth + 1)
            self.visit(dict(x.keywords), f"{name}.keywords", depth + 1)
        elif isinstance(x, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
            return
        elif hasattr(x, "__dict__") and not isinstance(x, (str, bytes, int, float, bool)):
            try:
                attrs = vars(x)
            except TypeError:
                return
            for k, v in list(attrs.items())[: self.max_items]:
                if type(v) not in self.skip and not k.startswith("__"):
                    self.visit(v, _join(name, k), depth + 1, (x, k, ATTR))

    def tensor(self, t: torch.Tensor, name: str, slot: Slot | None) -> None:
        """A tensor reached under ``name`` (at ``slot``): collected into :attr:`out`."""
        self.out.append((name or "tensor", t))

    def module(self, m: torch.nn.Module, name: str, depth: int) -> None:
        """A module: its buffers (and parameters), then every submodule's public attributes."""
        tensors = dict(m.named_buffers())
        if self.params:
            tensors.update(m.named_parameters())
        for k, t in tensors.items():
            self.visit(t, _join(name, k), depth + 1)
        for mod_name, mod in m.named_modules():
            for k, v in vars(mod).items():
                if not k.startswith("_"):
                    self.visit(v, _join(name, f"{mod_name}.{k}" if mod_name else k), depth + 1)

    def special(self, x: Any, name: str, depth: int) -> bool:
        """Claim ``x`` before the generic rules (True: handled, do not descend)."""
        return False


def _join(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


class _KindWalker(Walker):
    """Collects the objects of ``kind`` (e.g. ``torch.Generator``) instead of tensors."""

    def __init__(self, kind: type, *, params: bool) -> None:
        super().__init__(params=params)
        self.kind = kind
        self.found: list[tuple[str, Any]] = []

    def tensor(self, t: torch.Tensor, name: str, slot: Slot | None) -> None:
        return

    skip = _LEAVES | {torch.Tensor, torch.nn.Parameter}
    """Leaves and tensors (never a ``kind``: a large model's walk for generators opens no
    tensor, and a cache's thousands of tensors cost nothing)."""

    def module(self, m: torch.nn.Module, name: str, depth: int) -> None:
        """Every submodule's public attributes; not its parameters and buffers."""
        skip = self.skip
        for mod_name, mod in m.named_modules():
            for k, v in vars(mod).items():
                if type(v) not in skip and not k.startswith("_"):
                    self.visit(v, _join(name, f"{mod_name}.{k}" if mod_name else k), depth + 1)

    def special(self, x: Any, name: str, depth: int) -> bool:
        if isinstance(x, self.kind):
            self.found.append((name or self.kind.__name__.lower(), x))
            return True
        return False


def walk(
    obj: Any,
    prefix: str,
    *,
    params: bool,
    out: list[tuple[str, Any]],
    kind: type = torch.Tensor,
) -> None:
    """Append ``(name, obj)`` for every tensor (or object of ``kind``) reachable from
    ``obj`` to ``out``."""
    if kind is torch.Tensor:
        walker = Walker(params=params)
        walker.visit(obj, prefix)
        out.extend(walker.out)
        return
    found = _KindWalker(kind, params=params)
    found.visit(obj, prefix)
    out.extend(found.found)


def reachable_tensors(fn: Any, *, kind: type = torch.Tensor) -> list[tuple[str, Any]]:
    """Tensors a callable can reach, named as the user would: ``cache``, ``layers.0.k``.

    A bound method or a callable object: its owner's buffers, parameters and attributes.
    A function: its closure variables and the globals it names. A ``functools.partial``:
    its function and bound arguments. ``kind=torch.Generator`` collects the generators
    instead (:mod:`graphguard.rng` registers them with the graphs).
    """
    out: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        walk(list(fn.args), "args", params=True, out=out, kind=kind)
        walk(dict(fn.keywords), "", params=True, out=out, kind=kind)
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        walk(owner, "", params=True, out=out, kind=kind)
    elif isinstance(fn, torch.nn.Module) or not isinstance(fn, types.FunctionType):
        walk(fn, "", params=True, out=out, kind=kind)
    code = getattr(fn, "__code__", None)
    if code is not None:
        for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                walk(cell.cell_contents, var, params=True, out=out, kind=kind)
        glb = getattr(fn, "__globals__", {})
        for var in code.co_names:
            if var in glb:
                walk(glb[var], var, params=True, out=out, kind=kind)
    return out


__all__ = ["ATTR", "ITEM", "MAX_DEPTH", "Slot", "Walker", "reachable_tensors", "walk"]
