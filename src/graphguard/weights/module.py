"""The module whose weights a runner's graphs read: found behind the captured callable,
its tensors by name, what a derived tensor's slot holds now, and its whole tree re-proved
unchanged at C speed (:class:`Identity`).

Lookups on the live module, no record: what a capture saw of it is
:mod:`graphguard.weights.record`.
"""

from __future__ import annotations

import functools
import operator
import types
import weakref
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

import torch

# ------------------------------------------------------------------ which module


def find_module(fn: Any, _depth: int = 0) -> torch.nn.Module | None:
    """The module whose weights the captured callable reads, or None when not clear.

    The callable itself when it is a module; the module a bound method belongs to; for a
    method of another object (an engine, a wrapper), the one module among its attributes;
    the wrapped callable of a ``functools.partial`` or a compiled step; for a function, the
    one module its closure or the globals it names hold. Two candidates is ambiguous
    (None): pass ``weights=`` to the runner then.
    """
    if _depth > 3 or fn is None:
        return None
    if isinstance(fn, torch.nn.Module):
        return fn
    if isinstance(fn, functools.partial):
        found = find_module(fn.func, _depth + 1)
        return found if found is not None else _one(_modules_in([*fn.args, *fn.keywords.values()]))
    inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
    if inner is None and type(fn).__name__ == "CompiledStep":
        inner = getattr(fn, "fn", None)
    if inner is not None:
        return find_module(inner, _depth + 1)
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        if isinstance(owner, torch.nn.Module):
            return owner
        attrs = list(getattr(owner, "__dict__", {}).values())
        found = _one(_modules_in(attrs))
        if found is not None:
            return found
        inner_fns = [a for a in attrs if callable(a) and not isinstance(a, type)]
        return _one([m for a in inner_fns for m in [find_module(a, _depth + 1)] if m is not None])
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    glb = getattr(fn, "__globals__", {})
    cells += [glb[n] for n in code.co_names if n in glb]
    return _one(_modules_in(cells))


def _modules_in(values: Sequence[Any]) -> list[torch.nn.Module]:
    return [v for v in values if isinstance(v, torch.nn.Module)]


def _one(mods: Sequence[torch.nn.Module]) -> torch.nn.Module | None:
    unique = {id(m): m for m in mods}
    return next(iter(unique.values())) if len(unique) == 1 else None


# ------------------------------------------------------------------ its tensors


def named_tensors(
    module: torch.nn.Module,
) -> Iterator[tuple[str, tuple[str, ...], str, bool, bool, Any]]:
    """``(name, path, attr, is_buffer, persistent, tensor)`` of every parameter and buffer,
    tied and shared names included (``remove_duplicate=False``), in module order."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        path = tuple(prefix.split(".")) if prefix else ()
        for attr, t in sub._parameters.items():
            if t is not None:
                yield f"{prefix}.{attr}" if prefix else attr, path, attr, False, True, t
        skip = sub._non_persistent_buffers_set
        for attr, t in sub._buffers.items():
            if t is not None:
                name = f"{prefix}.{attr}" if prefix else attr
                yield name, path, attr, True, attr not in skip, t


def held_by(slot: Any) -> torch.Tensor | None:
    """What a derived tensor's slot ``(weakref to its submodule, steps)`` holds now (None:
    nothing, or not a tensor): a few lookups, no walk of the module. A step is
    ``("attr", name)``, ``("item", key)``, ``("cell", free variable)``, ``("arg", i)`` or
    ``("self", None)`` (see :func:`graphguard.owners.derived_tensors`)."""
    v: Any = slot[0]()
    try:
        for kind, key in slot[1]:
            if kind == "attr":
                v = object.__getattribute__(v, "__dict__").get(key)
            elif kind == "item":
                v = v[key]
            elif kind == "cell":
                v = v.__closure__[v.__code__.co_freevars.index(key)].cell_contents
            elif kind == "arg":
                v = v.args[key]
            else:
                v = v.__self__
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    return v if isinstance(v, torch.Tensor) else None


# ------------------------------------------------------------------ its identity


class Identity:
    """A module's whole tree as it is: every submodule, parameter and buffer in its owner
    dict, and every tensor's address and layout, re-proved at C speed (``map``).

    Each module's three dicts (``_parameters``, ``_buffers``, ``_modules``) hold every key
    they held, each the value it held (the same tensor, the same submodule, None where
    None), and no other key (their lengths add up as before): so no submodule was
    replaced or removed, no parametrization added or removed, no tensor registered (on a
    module that had none of its own too). Each tensor is then at its address (a ``.data =``
    swap keeps the object and moves the storage). For a 24-layer Llama (219 tensors, 319
    modules) about 1.6 times the cost of proving the tensors alone (35 us on a CPU core),
    2.5 times held weakly: what lets a repeated update, a weight sync and a capture's
    weight record reuse what was proved the last time. A module whose own dict attribute
    is replaced (``m._parameters = {...}``) is not seen when held strongly (no torch API
    does that)."""

    def __init__(
        self, module: torch.nn.Module, *, addresses: bool = True, weak: bool = False
    ) -> None:
        """``weak``: hold the modules and tensors by weak reference (a record kept for
        reuse must not keep a replaced weight's memory alive, nor a replaced submodule's:
        the user's reload frees it); each module's dicts are then looked up again at each
        proof."""
        mods = list({id(m): m for _, m in module.named_modules(remove_duplicate=False)}.values())
        dicts = _dicts_of(mods)
        where: list[int] = []  # per entry: the index of its dict in ``dicts``
        keys: list[str] = []
        held: list[Any] = []  # per entry: the tensor, the submodule, or None
        for i, d in enumerate(dicts):
            for k, v in d.items():
                where.append(i)
                keys.append(k)
                held.append(v)
        self._total = sum(map(len, dicts))
        self._keys = keys
        self._tensor_at = [i for i, v in enumerate(held) if isinstance(v, torch.Tensor)]
        self._valued_at = [i for i, v in enumerate(held) if v is not None]
        tensors = list(map(held.__getitem__, self._tensor_at))
        self._weak = weak
        if weak:
            self._mods: list[Any] = list(map(weakref.ref, mods))
            self._where = where
            self._refs = [weakref.ref(v) if v is not None else _none for v in held]
            self._held: list[Any] = []
            self._all: list[dict[str, Any]] = []
            self._dicts: list[dict[str, Any]] = []
        else:  # the dicts themselves: no lookup per proof
            self._mods, self._refs, self._held = [], [], held
            self._all, self._dicts = dicts, list(map(dicts.__getitem__, where))
            self._where = []
        self.ptrs = list(map(_data_ptr, tensors)) if addresses else None
        self._shapes = list(map(_shape, tensors))
        self._strides = list(map(_stride, tensors))

    @property
    def tensors(self) -> list[Any]:
        """The tensors recorded (weak: each one still alive, else None)."""
        held = [r() for r in self._refs] if self._weak else self._held
        return list(map(held.__getitem__, self._tensor_at))

    def unchanged(self) -> bool:
        """Whether the tree is as recorded and every tensor at the same address."""
        return self._live() is not None

    def intact(self) -> bool:
        """:meth:`unchanged`, and every tensor in the shape and stride recorded (an
        in-place re-layout, ``p.data = p.data.t()``, keeps the object and the address):
        one pass, the hot check of a repeated update."""
        live = self._live()
        return (
            live is not None
            and list(map(_shape, live)) == self._shapes
            and list(map(_stride, live)) == self._strides
        )

    def _live(self) -> list[Any] | None:
        """The tensors now, when the tree is as recorded and each tensor at its address."""
        if self._weak:
            mods = [r() for r in self._mods]
            if any(map(operator.is_, mods, repeat(None))):
                return None  # a module recorded is gone (replaced and freed)
            every = _dicts_of(mods)
            dicts = list(map(every.__getitem__, self._where))
            held = [r() for r in self._refs]
            if any(map(operator.is_, map(held.__getitem__, self._valued_at), repeat(None))):
                return None  # a tensor or submodule recorded is gone (replaced and freed)
        else:
            every, dicts, held = self._all, self._dicts, self._held
        now = list(map(dict.get, dicts, self._keys, repeat(_GONE)))
        if not all(map(operator.is_, now, held)):
            return None  # a key gone, or holding another value
        if sum(map(len, every)) != self._total:
            return None  # a key added (each recorded key is there: the dicts grew)
        live = list(map(now.__getitem__, self._tensor_at))
        if self.ptrs is not None and list(map(_data_ptr, live)) != self.ptrs:
            return None
        return live


def _dicts_of(mods: Sequence[torch.nn.Module]) -> list[dict[str, Any]]:
    """Every module's ``_parameters``, then every ``_buffers``, then every ``_modules``."""
    return [*map(_params_of, mods), *map(_buffers_of, mods), *map(_modules_of, mods)]


def _none() -> None:
    """The weak reference of a key registered as None (``bias=False``)."""
    return None


_GONE = object()
"""What ``dict.get`` answers for a key no longer there (never a recorded value)."""
_params_of = operator.attrgetter("_parameters")
_buffers_of = operator.attrgetter("_buffers")
_modules_of = operator.attrgetter("_modules")


_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_stride = torch.Tensor.stride


__all__ = ["Identity", "find_module", "held_by", "named_tensors"]
