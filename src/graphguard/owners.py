"""The named storages a runner's graphs may read, as sorted intervals.

Every tensor graphguard can name, highest priority first (:data:`KINDS`): the module's
parameters and buffers by path, declared state, static inputs, a graph's outputs, the
workspace arenas, and **derived** tensors (plain tensor attributes of the module's
submodules, one level into lists, tuples and dicts: ``self.wt = w.t().contiguous()`` made
at load). One owner per storage (the first); a word is resolved to its owner with one
``torch.searchsorted`` over the starts (:meth:`Owners.hit`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphguard._graph_args import Span
from graphguard.weights.record import named_tensors

KINDS = ("parameter", "buffer", "state", "static input", "output", "arena", "derived")
"""Named owner kinds, in priority order (a storage two owners share takes the first)."""


@dataclass(frozen=True)
class Owner:
    """One named storage a graph may read."""

    name: str
    kind: str
    start: int
    end: int
    ref: Any = field(default=None, compare=False, repr=False)
    """A weak reference to the storage (alive or not, at audit)."""
    slot: Any = field(default=None, compare=False, repr=False)
    """A derived tensor's place, ``(weakref to its submodule, steps from it)``: where a
    check finds what that name holds now without walking the module
    (:func:`graphguard.weights.record.held_by`)."""


_MODULE_ATTRS = frozenset(vars(torch.nn.Module()))
"""An ``nn.Module``'s own bookkeeping (hook dicts, flags): never a derived tensor. Skipped
by name: on a 16-layer Hugging Face model they are most of every submodule's ``vars``."""

_ITEMS = 64
"""Entries looked at in one list, tuple or dict."""

_LEAVES = (str, bytes, int, float, bool, complex, type, type(None), torch.dtype, torch.device)
_LEAF_TYPES = frozenset(_LEAVES)


def _walk(
    v: Any, name: str, steps: tuple[Any, ...], depth: int, seen: set[int], objects: bool = True
) -> Iterator[tuple[str, torch.Tensor, tuple[Any, ...]]]:
    """Tensors under one attribute value: the value itself, the entries of a list, tuple
    or dict, the attributes of a plain object (a kernel wrapper holding its workspace),
    the cells of a function's closure, a ``functools.partial``'s arguments; ``depth``
    levels down (at the last, tensors only), each object once (``seen``). ``steps``
    leads from the attribute's owner to the value (:func:`~graphguard.weights.record.held_by`)."""
    tv = type(v)  # issubclass on the type: an object's own __getattribute__ is not run
    if issubclass(tv, torch.Tensor):
        if not issubclass(tv, torch.nn.Parameter):
            yield name, v, steps
        return
    if depth <= 0 or issubclass(tv, (_LEAVES, torch.nn.Module)) or id(v) in seen:
        return
    seen.add(id(v))
    if issubclass(tv, (list, tuple)):
        for i, x in enumerate(v[:_ITEMS]):
            yield from _walk(x, f"{name}[{i}]", (*steps, ("item", i)), depth - 1, seen, objects)
    elif issubclass(tv, dict):
        for k, x in list(v.items())[:_ITEMS]:
            yield from _walk(x, f"{name}[{k!r}]", (*steps, ("item", k)), depth - 1, seen, objects)
    elif not objects:
        return
    elif tv is types.FunctionType:
        for var, cell in zip(v.__code__.co_freevars, v.__closure__ or ()):
            try:
                x = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _walk(x, f"{name}.<{var}>", (*steps, ("cell", var)), depth - 1, seen)
    elif tv is functools.partial:
        for i, x in enumerate(v.args[:_ITEMS]):
            yield from _walk(x, f"{name}.<arg {i}>", (*steps, ("arg", i)), depth - 1, seen)
    elif tv is types.MethodType:
        yield from _walk(v.__self__, name, (*steps, ("self", None)), depth, seen)
    elif not issubclass(tv, (type, types.ModuleType, set, frozenset)):
        try:
            attrs = object.__getattribute__(v, "__dict__")
        except AttributeError:  # no __dict__ (slots, a builtin)
            return
        for attr, x in list(attrs.items())[:_ITEMS]:
            if not attr.startswith("_"):  # an object's private state is its own business
                yield from _walk(x, f"{name}.{attr}", (*steps, ("attr", attr)), depth - 1, seen)


def derived_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """Tensors the module's submodules hold that no module lists: plain tensor attributes,
    and a level or two down, tensors in lists, tuples and dicts, and through public
    attributes in plain objects' attributes (a kernel object's workspace) and in closures
    of functions kept as attributes (a table a helper closes over): tensors derived at
    load. Each with its slot
    (:attr:`Owner.slot`): ``(weakref to the submodule, steps from it to the tensor)``."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        ref = None
        for attr, v in vars(sub).items():
            if attr in _MODULE_ATTRS or attr.startswith("__") or type(v) in _LEAF_TYPES:
                continue
            base = f"{prefix}.{attr}" if prefix else attr
            # Into objects and closures only through public attributes: a library's
            # private handles (a cached serving manager) hold its own buffers, not weights.
            walk = _walk(v, base, (("attr", attr),), 2, seen, not attr.startswith("_"))
            for name, t, steps in walk:
                ref = ref or weakref.ref(sub)
                yield name, t, (ref, steps)


def _owner(name: str, kind: str, t: torch.Tensor, slot: Any = None) -> Owner | None:
    try:
        st = t.untyped_storage()
        start, n = int(st.data_ptr()), int(st.nbytes())
    except (RuntimeError, NotImplementedError):
        return None
    if n <= 0 or t.device.type == "meta":
        return None
    return Owner(name, kind, start, start + n, StorageWeakRef(st), slot)  # type: ignore[no-untyped-call]


class Owners:
    """Named owner storages as sorted intervals (one owner per storage: the first given)."""

    def __init__(self, owners: Sequence[Owner], later: Sequence[Owner] = ()) -> None:
        """``owners`` before any output, ``later`` after (arenas, derived): what
        :meth:`plus` puts a graph's outputs between."""
        self._early, self._late = tuple(owners), tuple(later)
        by_start: dict[int, Owner] = {}
        for o in itertools.chain(owners, later):
            if o.end > o.start > 0 and o.start not in by_start:
                by_start[o.start] = o
        self.owners = [by_start[s] for s in sorted(by_start)]
        self.starts = torch.tensor([o.start for o in self.owners], dtype=torch.int64)
        self.ends = torch.tensor([o.end for o in self.owners], dtype=torch.int64)
        derived = [i for i, o in enumerate(self.owners) if o.kind == "derived"]
        self.derived = torch.tensor(derived, dtype=torch.int64)

    @classmethod
    def of(
        cls,
        *,
        module: torch.nn.Module | None,
        state: Any = None,
        static: Sequence[tuple[str, torch.Tensor]] = (),
        outputs: Sequence[Any] = (),
        arenas: Sequence[Any] = (),
    ) -> Owners:
        """Every named storage of a runner, highest priority first (:data:`KINDS`)."""
        early: list[Owner | None] = []
        if module is not None:
            params: list[Owner | None] = []
            bufs: list[Owner | None] = []
            for name, _, _, buffer, _, t in named_tensors(module):
                if buffer:
                    bufs.append(_owner(name, "buffer", t))
                else:
                    params.append(_owner(name, "parameter", t))
            early += params + bufs
        if state is not None:
            early += [_owner(n, "state", t) for n, t in zip(state.names, state.tensors)]
        early += [_owner(n, "static input", t) for n, t in static]
        late: list[Owner | None] = []
        for i, ws in enumerate(arenas):
            buf = getattr(ws, "buffer", None)
            if isinstance(buf, torch.Tensor):
                late.append(_owner(f"arena {getattr(ws, 'name', i)}", "arena", buf))
        if module is not None:  # last: an attribute that views a named storage is that owner
            late += [_owner(n, "derived", t, slot) for n, t, slot in derived_tensors(module)]
        made = cls([o for o in early if o], [o for o in late if o])
        return made.plus(outputs) if outputs else made

    def plus(self, outputs: Sequence[Any]) -> Owners:
        """These owners and a graph's output leaves (after the inputs, before arenas)."""
        leaves = [
            _owner(f"output leaf {i}", "output", t)
            for i, t in enumerate(outputs)
            if isinstance(t, torch.Tensor)
        ]
        return Owners([*self._early, *(o for o in leaves if o)], self._late)

    def adding(self, other: Owners) -> Owners:
        """These owners, and those of ``other`` of another name whose storage overlaps none
        of these (a fresh walk naming what a reused table could not: the table's names
        win, so a tensor moved since is still named where the capture saw it, and only
        there)."""
        spans = sorted((o.start, o.end) for o in self.owners)
        starts = [a for a, _ in spans]
        named = {o.name for o in self.owners}
        extra = []
        for o in other.owners:
            if o.name in named:  # moved since the walk: the graph reads where it was
                continue
            i = bisect.bisect_right(starts, o.start) - 1
            left = i >= 0 and spans[i][1] > o.start
            right = i + 1 < len(spans) and spans[i + 1][0] < o.end
            if not (left or right):
                extra.append(o)
        return Owners(list(self._early), [*self._late, *extra])

    def hit(self, words: torch.Tensor) -> torch.Tensor:
        """Per word, the index of the owner whose storage holds it, else -1."""
        return hit_spans(self.starts, self.ends, words)


def hit_spans(starts: torch.Tensor, ends: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    if starts.numel() == 0 or words.numel() == 0:
        return torch.full_like(words, -1)
    i = torch.searchsorted(starts, words, right=True) - 1
    j = i.clamp(min=0)
    return torch.where((i >= 0) & (words < ends[j]), j, torch.full_like(j, -1))


def spans_of(spans: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor]:
    s = sorted(spans)
    return (
        torch.tensor([a for a, _ in s], dtype=torch.int64),
        torch.tensor([b for _, b in s], dtype=torch.int64),
    )


def bounds(*groups: Iterable[Span]) -> tuple[int, int]:
    """The lowest start and highest end of every span given (0, 0: none)."""
    lo, hi = 1 << 63, 0
    for g in groups:
        for a, b in g:
            lo, hi = min(lo, a), max(hi, b)
    return (lo, hi) if hi else (0, 0)


__all__ = ["KINDS", "Owner", "Owners", "bounds", "derived_tensors", "hit_spans", "spans_of"]
