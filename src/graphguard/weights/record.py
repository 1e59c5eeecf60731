"""What a capture saw of a module's weights, and the check that they still serve.

:class:`WeightRecord` (taken at the end of each capture) and :meth:`Weights.check`
(every name resolved again on the module, compared with the record, no replay). The
lookups on the live module (which module, its tensors, its identity) are
:mod:`graphguard.weights.module`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from graphguard.errors import ConfigError, WeightsMovedError
from graphguard.weights.module import Identity, find_module, held_by, named_tensors

logger = logging.getLogger("graphguard")

GraphKey = tuple[int, int | None]
"""(size, piece index) of one graph; the piece is None for a FULL graph."""

_FIX = (
    "update it in place instead (param.copy_(new) under torch.no_grad(), "
    "load_state_dict(sd) without assign=True, or runner.update_weights(sd)), or recapture "
    "the graphs that read it: runner.recapture(reason=..., only_moved=True)"
)


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
