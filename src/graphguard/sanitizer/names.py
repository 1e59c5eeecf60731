"""Human names for the tensors a graph uses, and where each was reached (for rebinding).

Built at each captured forward from what the runner knows (its specs, workspaces,
callable), because a storage freed later can no longer tell where it came from. Each
tensor reached through an attribute, a dict key, a list slot or a module's parameter
or buffer table also records that *binding*, so a later ``module.weight = new`` can be
told apart from the tensor the graph captured (see :class:`Binding`).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphguard.sanitizer._common import storage
from graphguard.walk import ATTR, ITEM, Slot, Walker
from graphguard.workspace import Workspace


@dataclass
class Binding:
    """Where a named tensor lives: ``container[key]`` (``kind="item"``) or
    ``vars(container)[key]`` (``kind="attr"``), holding, at capture, the tensor ``ref``
    points to, on storage address ``data_ptr``."""

    container: Any
    key: Any
    kind: str
    path: str
    ref: Callable[[], torch.Tensor | None]
    data_ptr: int

    def current(self) -> Any:
        """What the binding holds now (``None`` when the slot is gone)."""
        try:
            if self.kind == ITEM:
                return self.container[self.key]
            return vars(self.container).get(self.key)
        except (KeyError, IndexError, TypeError):
            return None

    def rebound(self) -> bool:
        """Whether the slot now holds a tensor on another storage than at capture.

        The common case (the same tensor object) costs one lookup and one weakref call.
        A slot that now holds no tensor at all is not reported here: a freed storage
        is :class:`~graphguard.errors.FreedStorageError`'s business.
        """
        now = self.current()
        if now is None or now is self.ref():
            return False
        if not isinstance(now, torch.Tensor):
            return False
        st = storage(now)
        try:
            return st is None or int(st.data_ptr()) != self.data_ptr
        except RuntimeError:
            return True


class _NameWalker(Walker):
    """The state walker (:class:`graphguard.walk.Walker`) with the name table's rules:
    shallow (two levels; names are for messages, and the walk runs at every captured
    forward), every binding of a tensor kept (not deduplicated), parameters and
    buffers named as such, arenas registered."""

    def __init__(self, names: Names) -> None:
        super().__init__(
            max_depth=Names.DEPTH, max_nodes=4096, max_items=Names.LIMIT, dedupe_tensors=False
        )
        self.names = names

    def tensor(self, t: torch.Tensor, name: str, slot: Slot | None) -> None:
        self.names.add_tensor(t, name, (*slot, name) if slot is not None else None)

    def special(self, x: Any, name: str, depth: int) -> bool:
        if not isinstance(x, Workspace):
            return False
        self.names.arenas.append(x)
        self.names.add_tensor(x.buffer, f"workspace arena {x.name!r}")
        return True

    def module(self, m: torch.nn.Module, name: str, depth: int) -> None:
        add = self.names.add_tensor
        for mod_name, mod in m.named_modules(remove_duplicate=False):
            prefix = f"{name}.{mod_name}" if mod_name else name
            for n, p in list(mod._parameters.items()):
                if p is not None:
                    path = f"{prefix}.{n}"
                    add(p, f"parameter {path}", (mod._parameters, n, ITEM, path))
            for n, b in list(mod._buffers.items()):
                if b is not None:
                    path = f"{prefix}.{n}"
                    add(b, f"buffer {path}", (mod._buffers, n, ITEM, path))
            if depth < self.max_depth:
                for k, v in list(vars(mod).items())[: self.max_items]:
                    if not k.startswith("_") and isinstance(v, (torch.Tensor, Workspace)):
                        self.visit(v, f"{prefix}.{k}", self.max_depth, (mod, k, ATTR))


class Names:
    """Maps storage addresses to human names: static inputs, arenas, parameters, closures."""

    LIMIT = 256
    """Entries read from one container."""
    DEPTH = 2
    """Levels below each root."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, str] = {}
        self.bindings: dict[int, list[Binding]] = {}
        self.arenas: list[Workspace] = []
        self._walker = _NameWalker(self)

    def add_tensor(self, t: Any, name: str, slot: tuple[Any, Any, str, str] | None = None) -> None:
        """Name ``t``'s storage; ``slot`` is ``(container, key, kind, path)`` when known."""
        if not isinstance(t, torch.Tensor):
            return
        st = storage(t)
        if st is None:
            return
        with contextlib.suppress(RuntimeError):
            ptr = int(st.data_ptr())
            if not ptr:
                return
            self.by_ptr.setdefault(ptr, name)
            if slot is not None:
                container, key, kind, path = slot
                with contextlib.suppress(TypeError):
                    ref = weakref.ref(t)
                    self.bindings.setdefault(ptr, []).append(
                        Binding(container, key, kind, path, ref, ptr)
                    )

    def scan(self, obj: Any, label: str, slot: Slot | None = None) -> None:
        """Name the tensors reachable from ``obj`` (:attr:`DEPTH` levels, bounded);
        ``slot`` is ``(container, key, kind)`` where ``obj`` was found."""
        self._walker.visit(obj, label, 0, slot)

    def scan_callable(self, fn: Any) -> None:
        """The callable's module / bound object / callable object / closure / partial args."""
        if isinstance(fn, torch.nn.Module):
            self.scan(fn, type(fn).__name__)
            return
        inner = getattr(fn, "func", None)  # functools.partial
        if inner is not None and inner is not fn:
            for i, a in enumerate(getattr(fn, "args", ())):
                self.scan(a, f"partial arg {i}")
            self.scan_callable(inner)
            return
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, (type, types.ModuleType)):
            self.scan(owner, type(owner).__name__)
        func = getattr(fn, "__func__", fn)
        if not isinstance(func, types.FunctionType) and hasattr(fn, "__dict__"):
            # A plain object with __call__: its attributes, and its __call__'s globals.
            self.scan(fn, type(fn).__name__)
            func = next(
                (vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None
            )
        self._scan_code(func)

    def _scan_code(self, func: Any) -> None:
        code = getattr(func, "__code__", None)
        if code is None:
            return
        closure = getattr(func, "__closure__", None)
        if closure:
            for name, cell in zip(code.co_freevars, closure):
                with contextlib.suppress(ValueError):
                    self.scan(cell.cell_contents, name)
        globs = getattr(func, "__globals__", None)
        if isinstance(globs, dict):
            for name in code.co_names:
                value = globs.get(name)
                if isinstance(value, (torch.Tensor, torch.nn.Module, Workspace, dict, list)):
                    self.scan(value, name, slot=(globs, name, ITEM))


def runner_names(runner: Any) -> Names:
    """Names for everything a :class:`GraphRunner` knows it hands to its graphs."""
    names = Names()
    for spec, buf in zip(runner.specs, runner.static.buffers):
        names.add_tensor(buf, f"static input {spec.name!r}")
    for ws in runner.options.workspaces or ():
        names.scan(ws, ws.name)
    for leaves in runner.graph_outputs.values():
        for i, leaf in enumerate(leaves):
            names.add_tensor(leaf, f"static output leaf {i}")
    names.scan_callable(runner.fn)
    return names


__all__ = ["Binding", "Names", "runner_names"]
