"""A weight sync from a trainer's model into a continuous-batching engine: validated once,
then at each RL step a fused copy plus checks that cost microseconds.

Why. ``update_weights`` validates the whole source at every call (names, shapes, dtypes,
tied names, memory shared with a destination, each pair against every other), copies,
then proves every captured address again: about 15 ms of Python for the 219 tensors of a
24-layer Llama on a CPU core, where the fused copy of 0.5B bf16 weights takes well under a
millisecond on an H200. An RL loop pushes the same trainer tensors (its optimizer steps
them in place) into the same engine after every step, so all of that is decided once,
when the sync is built, and each call re-proves only what can change between steps.

Built (:meth:`GraphedContinuousBatching.weight_sync
<graphguard.integrations.hf_continuous.GraphedContinuousBatching.weight_sync>`): the
engine's graphs are checked (``check_weights``: nothing moved), the source module's
tensors are validated against the engine's model as ``update_weights`` validates a source
(one :class:`~graphguard.errors.ConfigError` listing every problem), and the pairs to copy
are grouped by device pair. Nothing is copied.

Each call, in order (:meth:`WeightSync.__call__`):

1. every source tensor is still the attribute of the trainer's module it was (an optimizer
   steps in place; ``module.weight = ...``, ``.to()``, a reshard re-creates one; the copy
   reads the source's own tensor objects, so a ``.data`` swap there is read as it is), and
   every parameter and buffer of the engine's model is still its live attribute at the
   address recorded when the sync was built, which is what every graph read (the
   graphs captured before were checked then; those captured since recorded the same
   tensors). Anything changed: the full ``update_weights`` runs instead (it validates
   again, and refuses a moved destination before copying: ``WeightsMovedError``), and
   the sync is rebuilt on what is live;
2. graphs captured since the last call: the derived-tensor refusal of ``update_weights``
   (a graph that reads a tensor no module lists would keep old values);
3. HF's prefix-cache refusal (requests holding blocks of a running manager);
4. the version counters of every engine tensor the copy writes, read (steps 1-4: about
   45 us of host time for a 24-layer Llama's 220 tensors on a CPU core, all before the
   copy is launched);
5. one ``torch._foreach_copy_`` per device pair under ``no_grad``; while the device
   copies, the counters are read again (torch advances a tensor's counter when a write
   to it is issued, so every name whose counter did not move was not written:
   ``versions_unchanged``) and HF's prefix cache is dropped (KV of the old weights), as
   ``update_weights`` does; then one device synchronize.

It returns a :class:`~graphguard.weights.WeightUpdate` like ``update_weights``, with the
same refit verdict (``refit``: what the copy writes against what the graphs read), worked
out when the sync is built and again when graphs were captured since, not per call, and
the counters' finding (``versions_checked``, ``versions_unchanged``): together they prove
at each call that every tensor the graphs read was written by it and none moved.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable
from typing import Any

import torch

from graphguard.errors import ConfigError
from graphguard.weights.plan import plan_copy
from graphguard.weights.record import Identity, named_tensors
from graphguard.weights.refit import RefitVerdict, Watch
from graphguard.weights.update import WeightUpdate, refuse_stale_derived


class WeightSync:
    """``sync()`` copies the trainer's ``source`` module into ``engine``'s model in place
    (see the module docstring for what each call proves). Build it with
    ``engine.weight_sync(policy)``."""

    def __init__(
        self,
        engine: Any,
        source: torch.nn.Module,
        *,
        strict: bool = True,
        caches: Callable[[], Any],
        drop: Callable[[Any], None],
    ) -> None:
        """``caches()``: HF's paged caches the engine may serve again (refusing what a
        weight change cannot leave right); ``drop(caches)``: forget their prefix hashes
        (:meth:`GraphedContinuousBatching.update_weights` documents both)."""
        if not isinstance(source, torch.nn.Module):
            raise ConfigError(
                f"weight_sync needs the trainer's module (its parameters are re-checked at "
                f"each call), got {type(source).__name__}; for a state dict or a file, call "
                "update_weights(...) instead"
            )
        if not isinstance(strict, bool):
            raise ConfigError(f"weight_sync: strict must be True or False, got {strict!r}")
        self.engine = engine
        self.source = source
        self._caches, self._drop = caches, drop
        self.strict = strict
        self.rebuilt = 0
        """Calls that found a tensor re-created and ran the full ``update_weights``."""
        self._build()

    def _given(self) -> dict[str, torch.Tensor]:
        from graphguard.integrations._hf_weights import hf_names

        given = {name: t for name, _, _, _, _, t in named_tensors(self.source)}
        return hf_names(self.engine.model, given)

    def _build(self) -> None:
        for check in self.engine.check_weights():
            check.raise_if_moved()
        plan = plan_copy(
            self.engine.model,
            self._given(),
            strict=self.strict,
            where="GraphedContinuousBatching.weight_sync",
        )
        buckets: dict[tuple[torch.device, torch.device], tuple[list[Any], list[Any]]] = {}
        for d, s in zip(plan.dsts, plan.srcs):
            dl, sl = buckets.setdefault((d.device, s.device), ([], []))
            dl.append(d)
            sl.append(s)
        self._buckets = list(buckets.values())
        self._devices = sorted({d.device for d in plan.dsts if d.device.type == "cuda"}, key=str)
        self._inference = any(d.is_inference() for d in plan.dsts)
        self.names: tuple[str, ...] = tuple(plan.names)
        """The engine's names the sync copies (tied names once)."""
        self.ignored, self.missing = tuple(plan.ignored), tuple(plan.missing)
        self.nbytes = sum(d.nbytes for d in plan.dsts)
        # The source's own objects are read by the copy (not detached views), so a ``.data``
        # swap there is read as it is; a rebound attribute is not, so identity is checked.
        self._source_record = Identity(self.source, addresses=False)
        self._engine_record = Identity(self.engine.model, addresses=True)
        # Version counters read around each copy: every engine name whose tensor the copy
        # writes (tied names too; an inference tensor has no counter: none are read then).
        written = {_key(d) for d in plan.dsts}
        counted = [
            (name, t)
            for name, _, _, _, _, t in named_tensors(self.engine.model)
            if _key(t) in written
        ]
        if self._inference:
            counted = []
        self.counted: tuple[str, ...] = tuple(n for n, _ in counted)
        """The names whose version counters each call reads before and after its copy."""
        self._counted = [t for _, t in counted]
        self._graphs = self._graph_count()
        self._plan = plan
        self._verdict = self._judge()

    def _judge(self) -> RefitVerdict | None:
        """The refit verdict of one sync (what the copy writes against what the graphs
        read): the same at every call while the plan and the graphs are, so it is worked
        out when either changes, not per call."""
        doors = [e.runner.door for e in self.engine.engines if e.runner.captured_sizes]
        if not doors:
            return None
        return Watch(doors, expect=None, observe=False).verdict([], copied=[self._plan])

    @property
    def pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The destinations and sources a call copies (one per storage), in copy order:
        what a bare ``torch._foreach_copy_`` of the same bytes takes."""
        dsts = [d for dl, _ in self._buckets for d in dl]
        srcs = [s for _, sl in self._buckets for s in sl]
        return dsts, srcs

    def _graph_count(self) -> tuple[tuple[int, int], ...]:
        return tuple((id(e), len(e.runner.captured_sizes)) for e in self.engine.engines)

    def __call__(self) -> WeightUpdate:
        # Before the copy is launched only what must refuse or decide it (tens of
        # microseconds for 220 tensors): identities, new graphs, HF's prefix-cache refusal,
        # the version counters the copy is about to advance. The rest runs while the device
        # copies, then one synchronize.
        t0 = time.perf_counter()
        if not (self._source_record.unchanged() and self._engine_record.unchanged()):
            update: WeightUpdate = self.engine.update_weights(self._given(), strict=self.strict)
            self.rebuilt += 1
            self._build()
            return update
        graphs = self._graph_count()
        if graphs != self._graphs:
            refuse_stale_derived([e.runner.door for e in self.engine.engines], None)
            self._graphs = graphs
            self._verdict = self._judge()
        caches = self._caches()  # its refusals come before any copy
        before = list(map(_counter, self._counted))
        with torch.inference_mode() if self._inference else torch.no_grad():
            for dl, sl in self._buckets:
                torch._foreach_copy_(dl, sl)
        # While the device copies: a launched copy has advanced the counter of every
        # tensor it writes (torch bumps it when the write is issued).
        after = list(map(_counter, self._counted))
        unchanged: tuple[str, ...] = ()
        if any(map(operator.eq, after, before)):
            unchanged = tuple(itertools.compress(self.counted, map(operator.eq, after, before)))
        self._drop(caches)  # HF's prefix cache: KV of the old weights
        for dev in self._devices:
            torch.cuda.synchronize(dev)  # done before the next replay, and timed honestly
        return WeightUpdate(
            copied=self.names,
            bytes=self.nbytes,
            seconds=time.perf_counter() - t0,
            ignored=self.ignored,
            missing=self.missing,
            refit=self._verdict,
            versions_checked=self.counted,
            versions_unchanged=unchanged,
        )


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """One storage view (what :func:`~graphguard.weights.plan.plan_copy` groups tied names
    by): tensors with the same key are written by one copy."""
    return (t.data_ptr() or -id(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)


_counter = operator.attrgetter("_version")


__all__ = ["WeightSync"]
