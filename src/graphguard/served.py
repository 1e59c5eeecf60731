"""The serving-time surface of a runner: weights, stats, the canary's table, ``verify``
and ``recapture``, each a short door into the room that does the work.

Why a layer of its own: these are what an engine calls between steps, never on the
replay path, and each belongs to a serving-time feature (:mod:`graphguard.weights`,
:mod:`graphguard.stats`, :mod:`graphguard.canary`, :mod:`graphguard.verify`). Every one
that synchronizes the device or changes what the graphs read runs under the runner's
capture guard (:class:`~graphguard.serving.CaptureGuard`): refused from inside the step
while a capture is open, waited for from another thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard import _graph_args
from graphguard.backend import free_graph
from graphguard.canary import CanaryStats
from graphguard.config import check_flag
from graphguard.errors import ConfigError
from graphguard.ladder import Ladder
from graphguard.provenance import Audit, Owners
from graphguard.report import CaptureReport
from graphguard.stats import ServingStats, serving_stats
from graphguard.verify import verify
from graphguard.weights.record import GraphKey, MovedWeight, WeightCheck, check
from graphguard.weights.update import WeightUpdate, recapture_moved, update_weights

logger = logging.getLogger("graphguard")


class Served(Ladder):
    """A :class:`~graphguard.ladder.Ladder` with its serving-time surface: the base of
    :class:`~graphguard.GraphRunner` and :class:`~graphguard.PiecewiseRunner`."""

    def recapture(self, *, reason: str, only_moved: bool = False) -> CaptureReport:
        """Drop every graph, unlock the arenas on purpose, and capture again (weights
        reloaded, a config changed); ``reason`` is required and logged, so it never happens
        by accident. It also retries the sizes whose capture failed or was refused.
        ``only_moved=True``: only the sizes whose graphs read a moved parameter or buffer
        (:meth:`check_weights`), into the same pool, arenas still locked; with provenance
        a PIECEWISE runner recaptures only the pieces that read it
        (:meth:`~graphguard.PiecewiseRunner.capture_pieces`). The report lists those
        sizes (none: nothing moved), and counts the graphs redone
        (``recaptured_graphs`` of ``graphs_total``)."""
        check_flag("only_moved", only_moved)
        if only_moved:
            check_reason(reason)
            with self.exclusive("recapture()"):
                partial = recapture_moved(self, reason=reason)
            return partial or CaptureReport(mode=self.mode.value, backend="none")
        start_over(self, reason)
        return self.capture()

    def update_weights(
        self,
        source: Any,
        *,
        on_moved: str = "raise",
        strict: bool = True,
        refresh: Callable[[], Any] | None = None,
    ) -> WeightUpdate:
        """Load new weights (a state dict, a module alike, or a loader) into the captured
        storages in place, all or nothing, then :meth:`check_weights`; ``on_moved`` is
        ``"raise"`` or ``"recapture"``. ``refresh``: called after the copy to re-derive the
        tensors graphs read that no module lists (provenance's "derived" reads); an update
        that would leave such tensors stale is refused without it.
        See :func:`graphguard.weights.update_weights`."""
        with self.exclusive("update_weights()"):
            return update_weights([self], source, on_moved=on_moved, strict=strict, refresh=refresh)

    def check_weights(self) -> WeightCheck:
        """Prove without replaying that every parameter and buffer each graph read at its
        capture is still the live tensor at the address, shape, stride and dtype that
        graph recorded (a ``WeightCheck``: true when nothing moved, ``.moved`` names each
        one with the sizes that read it; ``.raise_if_moved()``)."""
        with self.exclusive("check_weights()"):
            return check(self)

    def graph_reads(self) -> dict[int, set[int]] | None:
        """The storage addresses each captured graph reads (None: not known, so a moved
        weight recaptures every size): exact with provenance (every kernel argument read,
        :mod:`graphguard.provenance`); the sanitizer and the pieces know some."""
        return self._provenance.reads(self.captured_sizes)

    def reads_by_graph(self) -> dict[GraphKey, set[int]] | None:
        """Per graph ``(size, piece)`` (piece None: a FULL graph), the storage addresses
        it reads; None when not known graph by graph (provenance off or a graph unread)."""
        return self._provenance.graph_reads(self.captured_sizes)

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every graph this runner holds, ``(size, piece)``: one per captured size here
        (piece None); one per piece and size for a PIECEWISE runner."""
        return tuple((s, None) for s in self.captured_sizes)

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]:
        """The derived tensors (no module lists them) the graphs read, and those re-created
        since (with the sizes reading them); empty without provenance."""
        module = self._find_weights()
        return self._provenance.derived(module if isinstance(module, torch.nn.Module) else None)

    def audit(self) -> Audit:
        """What each graph (size; each piece) reads, by owner name and kind, and the words
        no owner explains: unknown (live, unnamed) and unowned (freed), with the kernel
        that took each; named reads whose owner moved since, and unnamed allocations a
        graph took that the allocator has freed since (CUDA), are listed as stale
        (:class:`~graphguard.provenance.Audit`; ``print(runner.audit())`` for the table).
        Each rank of a tensor-parallel group audits its own graphs (no collective)."""
        with self.exclusive("audit()"):
            backend = self._capture_backend()
            freed: list[tuple[int, int]] = []
            device = getattr(backend, "device", None)
            cuda = getattr(backend, "reads_graphs", None) == "cuda"
            if cuda and isinstance(device, torch.device) and self._provenance.graphs:
                freed = _graph_args.allocator_map(device, None)[2]
            return self._provenance.audit(self._owners(()), freed)

    def _owners(self, outputs: Sequence[Any]) -> Owners:
        """Every named storage this runner's graphs may read (:class:`Owners`)."""
        module = self._find_weights()
        return Owners.of(
            module=module if isinstance(module, torch.nn.Module) else None,
            state=self.state,
            static=[(s.name, b) for s, b in zip(self.specs, self.static.buffers)],
            outputs=outputs,
            arenas=self.options.workspaces or (),
        )

    def prove_graph(self, size: int, piece: int | None, graph: Any, outputs: Sequence[Any]) -> None:
        """Classify what a just-captured graph reads; a graph that takes a pointer into
        freed memory is destroyed and refused (:class:`~graphguard.errors.FreedStorageError`,
        which fails this size like any capture error) before any replay."""
        if not self._provenance.on:
            return
        try:
            self._provenance.take(size, piece, graph, self._owners(outputs))
        except BaseException:
            free_graph(graph)
            raise

    def stats(self) -> ServingStats:
        """Per size and in total: replays, eager calls and why, how and when each size was
        captured, graph memory against the budget, and the warnings so far
        (:mod:`graphguard.stats`; ``print(runner.stats())`` for the table)."""
        return serving_stats(
            self.label,
            self.sizes,
            lazy=self.lazy,
            serving=self._captured,
            captured=self._table.sizes,
            refused=self._refused,
            counters=self._counters,
            ledger=self.ledger,
            entries=self._entries,
        )

    def canary_stats(self) -> dict[int, CanaryStats]:
        """Per captured size, what the canary saw (checks, divergences, the last report,
        whether it is served eagerly); ``{}`` without ``canary=`` (:mod:`graphguard.canary`)."""
        return self._canary.stats_table() if self._canary is not None else {}

    def verify(self, **kwargs: Any) -> Any:
        """Replay every captured size on fresh inputs and compare with eager
        (:func:`graphguard.verify`)."""
        with self.exclusive("verify()"):
            return verify(self, **kwargs)


def check_reason(reason: object) -> None:
    """A recapture is never an accident: it names why."""
    if not reason or not isinstance(reason, str):
        raise ConfigError("recapture needs a reason, e.g. recapture(reason='weights reloaded')")


def start_over(runner: Ladder, reason: str) -> None:
    """The first half of every full recapture (this runner's and a distributed one's):
    drop every graph and unlock the arenas on purpose, logged with ``reason``."""
    check_reason(reason)
    with runner.exclusive("recapture()"):
        logger.warning("%s: recapturing (%s)", runner.name, reason)
        runner.release()
        for ws in runner.options.workspaces or ():
            ws.unlock(reason=reason)


__all__ = ["Served", "check_reason", "start_over"]
