"""What a runner's graphs read, and whether it still holds: the part of a runner that
answers ``check_weights()``, ``audit()``, a refit's question and provenance's staging.

Why a part of its own: these questions share their inputs -- the module the weights live
in, the named storages a graph may read (:class:`~graphguard.provenance.Owners`),
provenance's per-graph proofs and each capture's :class:`WeightRecord` on the store's
records -- and none of them captures or replays. The ladder asks them in one line each,
under its capture guard; this part never takes the guard and never touches the device
except to read the allocator's map for ``audit()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphguard import _graph_args
from graphguard.backend import Captured
from graphguard.errors import GraphGuardError
from graphguard.ladder.store import GraphStore
from graphguard.provenance import Audit, Owners, Provenance
from graphguard.state import StateSet
from graphguard.weights.record import (
    GraphKey,
    MovedWeight,
    WeightCheck,
    WeightRecord,
    Weights,
    find_module,
    held_by,
    with_derived,
)
from graphguard.weights.refit import RefitReads


class GraphReads:
    """What one runner's graphs read (see the module docstring)."""

    def __init__(
        self,
        label: str,
        store: GraphStore,
        provenance: Provenance,
        *,
        fn: Any,
        weights: Any,
        state: StateSet | None,
        static: Sequence[tuple[str, torch.Tensor]],
        arenas: Sequence[Any],
    ) -> None:
        self.label = label
        self.provenance = provenance
        self._store = store
        self._fn = fn
        self._weights_option = weights
        self._state = state
        self._static = static
        self._arenas = arenas
        self._weights: Weights | None = None
        self._walked: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ the module

    def module(self) -> Any:
        """The module the weights live in: ``CaptureOptions(weights=...)``, else the one
        found behind the callable (None: not one clear module)."""
        if self._weights_option is not None:
            return self._weights_option
        return find_module(self._fn)

    def weights(self) -> Weights:
        """The module ``update_weights`` and ``check_weights`` cover (a ConfigError naming
        the fix when there is none)."""
        if self._weights is None:
            self._weights = Weights.of(self.label, self.module(), self._fn)
        return self._weights

    def record_weights(self) -> WeightRecord | None:
        """Every parameter and buffer's address now (None: no module to record)."""
        module = self.module()
        return self.weights().take() if isinstance(module, torch.nn.Module) else None

    # ------------------------------------------------------------------ provenance

    def owners(self, outputs: Sequence[Any]) -> Owners:
        """Every named storage the graphs may read (:class:`Owners`)."""
        module = self.module()
        return Owners.of(
            module=module if isinstance(module, torch.nn.Module) else None,
            state=self._state,
            static=self._static,
            outputs=outputs,
            arenas=self._arenas,
        )

    def _signature(self) -> tuple[int, ...]:
        """Where the runner's own named storages are (state, static inputs, arenas)."""
        ts = [
            *(self._state.tensors if self._state is not None else ()),
            *(t for _, t in self._static),
        ]
        ts += [
            b
            for b in (getattr(ws, "buffer", None) for ws in self._arenas)
            if isinstance(b, torch.Tensor)
        ]
        return tuple(int(t.untyped_storage().data_ptr()) for t in ts)

    def _walk(self) -> Owners:
        """A capture run's owners: the walk of the module (with where the runner's own
        storages were, for :meth:`_still`)."""
        self._walked = self._signature()
        return self.owners(())

    def _still(self, owners: Owners) -> bool:
        """Whether the last run's owners table still names every storage a graph may
        read as it did: every parameter and buffer the same tensor at the same address
        and layout since the last capture's record (:meth:`Weights.unchanged_since_last
        <graphguard.weights.record.Weights.unchanged_since_last>`), each derived attribute
        holding the same storage, and the state, static inputs and arenas where they were.
        An attribute made since is not in the table: the graph's read looks for it in a
        fresh walk (:meth:`Provenance.resolve <graphguard.provenance.Provenance.resolve>`)."""
        if not isinstance(self.module(), torch.nn.Module) or self._weights is None:
            return False
        if not self._weights.unchanged_since_last() or self._walked != self._signature():
            return False
        for o in owners.owners:
            if o.kind == "derived":
                t = held_by(o.slot) if o.slot is not None else None
                if t is None or int(t.untyped_storage().data_ptr()) != o.start:
                    return False
        return True

    def before_capture(self) -> None:
        """Under the sanitizer, the owners as a capture begins, kept as history: a step that
        drops a module attribute inside the capture (``self.cache = None``) leaves the graph
        a pointer into memory no walk after it can name; this one can (the
        :class:`~graphguard.errors.FreedStorageError` names ``cache``, its last owner)."""
        prov = self.provenance
        if prov.on and prov.strict:
            prov.saw(self.owners(()))

    def prove(
        self, size: int, piece: int | None, captured: Captured, outputs: Sequence[Any]
    ) -> None:
        """Stage what a just-captured graph reads (:meth:`Provenance.take
        <graphguard.provenance.Provenance.take>`: read on the first question; under the
        sanitizer now, a graph taking freed memory failing its size before any replay)."""
        prov = self.provenance
        if not prov.on:
            return
        owners = prov.run_owners(self._walk, self._still)
        got = prov.take(
            size, piece, captured.args, captured.graph, owners.plus(outputs) if outputs else owners
        )
        self._store.keep_reads((size, piece), got)

    def taken(self, size: int) -> Any:
        """What provenance proved the graphs of ``size`` take (the door's ``taken``)."""
        return self.provenance.taken(self._store.records, size)

    # ------------------------------------------------------------------ the questions

    def check(self, extra: dict[GraphKey, set[int]], *, none: bool) -> WeightCheck:
        """``check_weights()`` (the caller holds the guard): each graph's record against
        the live tensors. What each graph reads is provenance's proof, with what the kind
        knows without it (``extra``: the pieces' in-place inputs, the sanitizer's
        storages); per size when either knows, per graph only with provenance (the kind's
        knowledge is per size). ``none``: the runner's mode is none."""
        store = self._store
        taken = store.weight_records()
        room = self.weights()
        if not taken and (none or store.serving):
            # No graph reads anything: mode none, or a lazy runner with no size captured yet.
            return WeightCheck(room.owner, 0, (), (), True, 0.0)
        if not taken:
            raise GraphGuardError(
                f"{self.label}: check_weights() before capture(): there is no captured "
                "address to compare with; capture first"
            )
        proven = self.provenance.graph_reads(store.records, store.version)
        per_graph: dict[GraphKey, set[int]] | None = None
        reads: dict[int, set[int]] | None = None
        if proven is not None or extra:
            per_graph = {k: set(v) for k, v in extra.items()}
            for key, addrs in (proven or {}).items():
                per_graph.setdefault(key, set()).update(addrs)
            reads = {}
            for (size, _), addrs in per_graph.items():
                reads.setdefault(size, set()).update(addrs)
        if proven is None:
            per_graph = None
        found = room.check(taken, reads, per_graph)
        derived, moved = self.derived()
        return with_derived(found, derived, moved, per_graph is not None)

    def derived(self) -> tuple[tuple[str, ...], list[MovedWeight]]:
        """The derived tensors the graphs read, and those re-created since, per graph."""
        store = self._store
        return self.provenance.derived(store.records, store.version)

    def refit_reads(self) -> RefitReads:
        """What a refit classifies: the named storages the graphs read (None: not known)."""
        store, prov = self._store, self.provenance
        named = prov.named(store.records, store.version) if prov.on else None
        records = {id(r): r for r in store.weight_records().values()}
        return RefitReads(self.label, named, tuple(records.values()), store.graphs.graph_keys())

    def audit(self, reads_graphs: str | None, device: torch.device) -> Audit:
        """``audit()`` (the caller holds the guard): every graph's reads, checked against
        the owners now and, on CUDA, the allocator's free blocks now."""
        store = self._store
        freed: list[tuple[int, int]] = []
        self.provenance.resolve(store.records)
        if reads_graphs == "cuda" and any(r.reads for r in store.records.values()):
            freed = _graph_args.AllocatorMap(device).freed
        return self.provenance.audit(store.records, self.owners(()), freed, store.version)


__all__ = ["GraphReads"]
