"""What a capture saw of a module's weights, and the check that they still serve.

:class:`WeightRecord` (taken at the end of each capture) and :meth:`Weights.check`
(every name resolved again on the module, compared with the record, no replay).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import time
import types
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import torch

from graphguard.errors import ConfigError, WeightsMovedError

logger = logging.getLogger("graphguard")

GraphKey = tuple[int, int | None]
"""(size, piece index) of one graph; the piece is None for a FULL graph."""

_FIX = (
    "update it in place instead (param.copy_(new) under torch.no_grad(), "
    "load_state_dict(sd) without assign=True, or runner.update_weights(sd)), or recapture "
    "the graphs that read it: runner.recapture(reason=..., only_moved=True)"
)


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


# ------------------------------------------------------------------ the record


class _Slot(NamedTuple):
    """One named parameter or buffer as a capture saw it (a tuple: every capture takes one
    per parameter and buffer, and a frozen dataclass cost twice the time to build)."""

    name: str
    path: tuple[str, ...]
    attr: str
    buffer: bool
    persistent: bool
    ref: Any  # weakref.ref to the tensor object: rebound vs. its data moved
    data_ptr: int
    storage_ptr: int
    storage_nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


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


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())


class WeightRecord:
    """Every parameter and buffer of a module as a capture saw it (see the module doc)."""

    def __init__(self, module: torch.nn.Module) -> None:
        slots = []
        for name, path, attr, buffer, persistent, t in named_tensors(module):
            st = t.untyped_storage()
            slots.append(
                _Slot(
                    name,
                    path,
                    attr,
                    buffer,
                    persistent,
                    weakref.ref(t),
                    t.data_ptr(),
                    st.data_ptr(),
                    st.nbytes(),
                    t.shape,
                    t.stride(),
                    t.dtype,
                )
            )
        self.slots: tuple[_Slot, ...] = tuple(slots)


def _resolve(root: torch.nn.Module, slot: _Slot) -> Any:
    m: Any = root
    for part in slot.path:
        m = m._modules.get(part)
        if m is None:
            return None
    table = m._buffers if slot.buffer else m._parameters
    t = table.get(slot.attr)
    return t if t is not None else (m._parameters if slot.buffer else m._buffers).get(slot.attr)


def _change(slot: _Slot, t: Any) -> str | None:
    """What changed about ``slot`` (None: the live tensor is the captured storage)."""
    if not isinstance(t, torch.Tensor):
        return "no longer a parameter or buffer of the module (deleted or replaced by a non-tensor)"
    ptr = t.data_ptr()
    if (
        ptr == slot.data_ptr
        and t.dtype == slot.dtype
        and t.shape == slot.shape
        and t.stride() == slot.stride
    ):
        sptr, nbytes = _storage(t)
        if nbytes == slot.storage_nbytes and sptr == slot.storage_ptr:
            return None
        return f"its storage was resized from {slot.storage_nbytes} to {nbytes} bytes"
    who = "the same tensor, its data moved" if slot.ref() is t else "replaced by a new tensor"
    parts = [f"{slot.data_ptr:#x} -> {ptr:#x}" if ptr != slot.data_ptr else "same address"]
    if t.dtype != slot.dtype:
        parts.append(f"dtype {dtype_name(slot.dtype)} -> {dtype_name(t.dtype)}")
    if t.shape != slot.shape:
        parts.append(f"shape {list(slot.shape)} -> {list(t.shape)}")
    if t.stride() != slot.stride:
        parts.append(f"stride {list(slot.stride)} -> {list(t.stride())}")
    return f"{who} ({', '.join(parts)})"


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class MovedWeight:
    """A parameter or buffer whose live tensor is no longer the storage the graphs read."""

    name: str
    change: str
    """What changed (``replaced by a new tensor (0x... -> 0x...)``, a dtype, a resize)."""
    sizes: tuple[int, ...]
    """The captured sizes whose graphs read its old storage (all when not known)."""
    graphs: tuple[GraphKey, ...] = ()
    """The graphs ``(size, piece)`` that read its old storage, when reads are known per
    graph (provenance: each PIECEWISE piece apart; piece None for a FULL graph); empty
    when they are known per size at most."""
    layout_changed: bool = False
    """Its dtype, shape or stride changed too (not only its address): a piece of a
    PIECEWISE runner then cannot be recaptured alone (dynamo guards on the layout)."""


@dataclass(frozen=True)
class WeightCheck:
    """What :meth:`check_weights` found; true when nothing moved."""

    owner: str
    checked: int
    """Names compared (parameters and buffers, tied names counted once each)."""
    moved: tuple[MovedWeight, ...]
    sizes: tuple[int, ...]
    """The captured sizes whose graphs read a moved storage: what a recapture must redo."""
    reads_known: bool
    """Whether graphguard knew which graph reads which storage (else: every graph)."""
    seconds: float
    derived: tuple[str, ...] = ()
    """Tensors the graphs read that no module lists as a parameter or buffer (derived at
    load, e.g. a transposed weight): known with provenance (:mod:`graphguard.provenance`);
    an update leaves them stale unless re-derived (``update_weights(refresh=...)``). One
    re-created at a new address since capture is also in :attr:`moved`."""
    graphs: tuple[GraphKey, ...] = ()
    """The graphs ``(size, piece)`` reading a moved storage, when reads are known per graph
    (:attr:`MovedWeight.graphs`): what a PIECEWISE recapture redoes, piece by piece."""

    @property
    def ok(self) -> bool:
        """Nothing moved: every graph reads the live tensors."""
        return not self.moved

    def __bool__(self) -> bool:
        return self.ok

    def by_piece(self) -> dict[int, set[int]] | None:
        """Per size, the pieces whose graphs read a moved storage: what a PIECEWISE
        recapture redoes alone. None when that is not known piece by piece for every
        moved tensor read, or when one also changed its layout (dynamo guards on it)."""
        if not self.graphs or any(m.layout_changed for m in self.moved):
            return None
        if {s for s, _ in self.graphs} != set(self.sizes):
            return None
        out: dict[int, set[int]] = {}
        for size, piece in self.graphs:
            if piece is None:
                return None
            out.setdefault(size, set()).add(piece)
        return out

    def message(self) -> str:
        """What moved, by name, which sizes read it, and the fix (one readable block)."""
        if self.ok:
            return (
                f"{self.owner}: all {self.checked} parameters and buffers at their captured address"
            )
        shown = "\n  - ".join(f"{m.name}: {m.change}" for m in self.moved[:20])
        more = f"\n  ... and {len(self.moved) - 20} more" if len(self.moved) > 20 else ""
        who = (
            f"the graphs of sizes {list(self.sizes)} read"
            if self.sizes
            else "no captured graph reads"
        )
        how = "" if self.reads_known else " (which graph reads what is not known: all of them)"
        if self.derived:
            how += f" (derived tensors the graphs read: {', '.join(self.derived[:8])})"
        extra = f" and {len(self.derived)} derived" if self.derived else ""
        return (
            f"{self.owner}: {len(self.moved)} tensor(s) moved since capture (of "
            f"{self.checked} parameters/buffers{extra} checked), and {who} the old "
            f"storage{how}:\n  - {shown}{more}\nTo fix: {_FIX}"
        )

    def raise_if_moved(self) -> None:
        """Raise :class:`~graphguard.errors.WeightsMovedError` listing what moved."""
        if self.moved:
            raise WeightsMovedError(self.message(), names=tuple(m.name for m in self.moved))


class Weights:
    """A runner's module (``weights=`` or :func:`find_module`): what
    :meth:`~graphguard.GraphRunner.update_weights` writes and
    :meth:`~graphguard.GraphRunner.check_weights` checks. What each graph's capture saw of
    it is a :class:`WeightRecord` on that graph's record
    (:class:`~graphguard.ladder.record.GraphRecord`): per graph, because a later capture
    (a lazy size, a partial recapture) must never hide an older graph's stale read, so
    each graph is checked against the addresses *it* recorded."""

    def __init__(self, owner: str, module: torch.nn.Module) -> None:
        self.owner = owner
        self.module = module
        self.cache: dict[str, Any] = {}
        """What an update proved of this module and may reuse while nothing changed (the
        validated copy plan: :mod:`graphguard.weights.plan`)."""
        self._last: WeightRecord | None = None
        self._seen: Identity | None = None
        """The module's tree and tensors as ``_last`` was taken (a submodule replaced, a
        parametrization removed, a tensor registered since: seen), re-proved in
        microseconds."""

    @classmethod
    def of(cls, owner: str, module: Any, fn: Any) -> Weights:
        """The room of ``module`` (``weights=`` or :func:`find_module`), or a ConfigError."""
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                f"{owner}: no single nn.Module found behind the callable "
                f"({type(fn).__name__}) for update_weights/check_weights"
                + (f"; weights= is a {type(module).__name__}" if module is not None else "")
                + ": pass the model as options=graphguard.CaptureOptions(weights=model) to "
                "the runner"
            )
        return cls(owner, module)

    def take(self) -> WeightRecord:
        """Every parameter and buffer's address now (the end of a capture, or a check
        that found the graphs' records current). The last record taken when nothing
        differs: graphs captured at different times over the same tensors share one
        record, so a check compares each tensor once, not once per lazy size."""
        last, seen = self._last, self._seen
        if last is not None and seen is not None and self.unchanged_since_last():
            return last  # every tensor the same object, address and layout: no walk
        rec = WeightRecord(self.module)
        if last is not None and _same_slots(last, rec):
            rec = last
        self._last = rec
        self._seen = Identity(self.module, weak=True)
        return rec

    def unchanged_since_last(self) -> bool:
        """Whether the module's tree is as at the last :meth:`take` (every submodule,
        parameter and buffer the same object under the same name, none added) and every
        tensor at the address and in the layout it had (:class:`Identity`: a lazy
        capture's record costs microseconds instead of a walk of the module). A
        recapture after a submodule was replaced or a parametrization removed therefore
        records the module as it is now, never the last record again."""
        return self._seen is not None and self._seen.intact()

    def check(
        self,
        taken: Mapping[int, WeightRecord],
        reads: Mapping[int, set[int]] | None,
        per_graph: Mapping[GraphKey, set[int]] | None = None,
    ) -> WeightCheck:
        """Compare the live tensors with each captured size's record (``taken``); ``reads``
        maps a size to the storage (and data) addresses its graph reads, None when not
        known; ``per_graph`` the same per graph ``(size, piece)`` when known (provenance),
        else None."""
        t0 = time.perf_counter()
        by_record: dict[int, tuple[WeightRecord, list[int]]] = {}
        for size, rec in taken.items():
            by_record.setdefault(id(rec), (rec, []))[1].append(size)
        moved: dict[str, tuple[str, list[int], list[GraphKey], bool]] = {}
        checked = 0
        for rec, rec_sizes in by_record.values():
            checked = max(checked, len(rec.slots))
            for slot, what, relaid, gone in self._moved(rec):
                if reads is None:
                    read_by = rec_sizes
                else:
                    read_by = [
                        s
                        for s in rec_sizes
                        if slot.storage_ptr in reads.get(s, ()) or slot.data_ptr in reads.get(s, ())
                    ]
                    if gone and not read_by:
                        # No longer on the module, and no graph reads its old storage: not
                        # moved, gone (a parametrization removed, a submodule replaced by
                        # one without it); a graph that reads it is still reported.
                        continue
                graphs: list[GraphKey] = []
                if per_graph is not None:
                    mine = set(rec_sizes)
                    graphs = [
                        key
                        for key, addrs in per_graph.items()
                        if key[0] in mine and (slot.storage_ptr in addrs or slot.data_ptr in addrs)
                    ]
                entry = moved.setdefault(slot.name, (what, [], [], relaid))
                entry[1].extend(read_by)
                entry[2].extend(graphs)
        out = tuple(
            MovedWeight(name, what, tuple(sorted(r)), _sorted_keys(g), relaid)
            for name, (what, r, g, relaid) in moved.items()
        )
        return WeightCheck(
            owner=self.owner,
            checked=checked,
            moved=out,
            sizes=tuple(sorted({s for m in out for s in m.sizes})),
            reads_known=reads is not None,
            seconds=time.perf_counter() - t0,
            graphs=_sorted_keys([k for m in out for k in m.graphs]),
        )

    def _moved(self, record: WeightRecord) -> list[tuple[_Slot, str, bool, bool]]:
        """Each slot of ``record`` whose live tensor changed: what changed, whether its
        layout (dtype, shape, stride) changed too, and whether its name is gone (no
        tensor on the module answers to it now)."""
        moved: list[tuple[_Slot, str, bool, bool]] = []
        root = self.module
        for slot in record.slots:
            # The common case inline (a Python loop over ~150 tensors after every update):
            # the module path walked again, then address, dtype, shape, stride, bytes.
            m: Any = root
            for part in slot.path:
                m = m._modules.get(part)
                if m is None:
                    break
            t = None if m is None else (m._buffers if slot.buffer else m._parameters).get(slot.attr)
            if (
                t is not None
                and t.data_ptr() == slot.data_ptr
                and t.dtype is slot.dtype
                and t.shape == slot.shape
                and t.stride() == slot.stride
                and t.untyped_storage().nbytes() == slot.storage_nbytes
            ):
                continue
            now = _resolve(root, slot)
            what = _change(slot, now)
            if what is not None:
                gone = not isinstance(now, torch.Tensor)
                moved.append((slot, what, _relaid(slot, now), gone))
        return moved


def _same_slots(a: WeightRecord, b: WeightRecord) -> bool:
    """Two records of the same tensors at the same addresses and layouts."""
    if len(a.slots) != len(b.slots):
        return False
    return all(
        x.ref() is y.ref() and x[:5] == y[:5] and x[6:] == y[6:] for x, y in zip(a.slots, b.slots)
    )


def _relaid(slot: _Slot, t: Any) -> bool:
    """Whether ``t`` differs from what ``slot`` recorded in more than its address."""
    if not isinstance(t, torch.Tensor):
        return True
    return t.dtype != slot.dtype or t.shape != slot.shape or tuple(t.stride()) != slot.stride


def _sorted_keys(keys: Sequence[GraphKey]) -> tuple[GraphKey, ...]:
    """Graph keys once each, by size then piece (a FULL graph's None first)."""
    return tuple(sorted(set(keys), key=lambda k: (k[0], -1 if k[1] is None else k[1])))


def with_derived(
    found: WeightCheck, derived: tuple[str, ...], moved: Sequence[MovedWeight], per_graph: bool
) -> WeightCheck:
    """``found`` with provenance's derived reads added (``derived``: every derived tensor a
    graph reads; ``moved``: those re-created since, graph by graph)."""
    if not derived:
        return found
    return dataclasses.replace(
        found,
        derived=derived,
        moved=found.moved + tuple(moved),
        sizes=tuple(sorted({*found.sizes, *(s for m in moved for s in m.sizes)})),
        graphs=_sorted_keys([*found.graphs, *(k for m in moved for k in m.graphs)])
        if per_graph
        else (),
    )


__all__ = [
    "GraphKey",
    "Identity",
    "MovedWeight",
    "WeightCheck",
    "WeightRecord",
    "Weights",
    "dtype_name",
    "find_module",
    "held_by",
    "named_tensors",
    "with_derived",
]
