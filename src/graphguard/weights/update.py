"""Weight updates into live graphs: validated first, one fused copy, then a verdict.

:func:`update_weights` (a state dict, a module or a loader, all or nothing) and
:func:`refit` (``with runner.refit(): loader(model)``): one sequence for every runner
kind (a runner, the dispatcher's two runners over one model, ``GraphedCausalLM``, the
continuous-batching engines, a tensor-parallel rank). Both end with the same
:class:`~graphguard.weights.refit.RefitVerdict` (:mod:`graphguard.weights.refit`):
every tensor the graphs read, moved, derived, written or not written.

Before anything is written: :mod:`graphguard.weights.validate`; how every change ends
(the ranks' agreement, recapture, :class:`WeightUpdate`): :mod:`graphguard.weights.settle`.

Cost. An RL loop updates the same model from the same structure of tensors after every
step, so the validated copy plan is reused while nothing changed
(:func:`graphguard.weights.plan.cached_plan`), the copy is launched before the checks,
and the checks (``check_weights``, the verdict from what was copied) run on the host
while the device copies; one synchronize ends the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphguard.errors import ConfigError
from graphguard.weights.plan import (
    CopyPlan,
    cached_plan,
    finish_copy,
    launch_copy,
    plan_copy,
    refuse_overlaps,
)
from graphguard.weights.protocols import Agreeing, Recapture, Refit
from graphguard.weights.record import WeightCheck, Weights
from graphguard.weights.refit import RefitContext, RefitVerdict, Watch
from graphguard.weights.settle import WeightUpdate, settle
from graphguard.weights.validate import (
    ON_MOVED,
    check_flags,
    check_moved_before,
    check_on_moved,
    refuse_stale_derived,
    remember_proven,
    still_proven,
)

logger = logging.getLogger("graphguard")


# ------------------------------------------------------------------ the update


def _unique_rooms(targets: Sequence[Refit]) -> list[Weights]:
    rooms: dict[int, Weights] = {}
    for t in targets:
        room = t.weights
        rooms.setdefault(id(room.module), room)
    return list(rooms.values())


def prepare(
    targets: Sequence[Refit], source: Any, *, strict: bool, proven: bool = False
) -> tuple[list[CopyPlan], bool]:
    """Run a loader callable (then nothing is left to copy), or validate ``source``
    against every distinct module of ``targets``; nothing is copied yet. Every problem of
    every module (and every source sharing memory with any tensor written) is listed in
    one ConfigError. A module's last plan is reused while nothing changed."""
    where = " / ".join(t.label for t in targets)
    if callable(source) and not isinstance(source, (torch.nn.Module, Mapping)):
        result = source()
        if not isinstance(result, (torch.nn.Module, Mapping)):
            return [], True  # it loaded in place (e.g. model.load_state_dict(sd))
        source = result
    rooms = _unique_rooms(targets)
    return plans_for(rooms, source, strict=strict, where=where, proven=proven), False


def plans_for(
    rooms: Sequence[Weights], source: Any, *, strict: bool, where: str, proven: bool = False
) -> list[CopyPlan]:
    """The validated plan of ``source`` into each room (cached per room; several modules:
    validated together, so a source sharing memory with any destination is refused).
    ``proven``: :func:`still_proven` just held (the kept plan's tensors unchanged)."""
    if len(rooms) == 1:
        return [cached_plan(rooms[0], source, strict=strict, where=where, proven=proven)[0]]
    plans = [plan_copy(r.module, source, strict=strict, where=where) for r in rooms]
    refuse_overlaps(plans, where)
    return plans


def update_weights(
    targets: Sequence[Refit],
    source: Any,
    *,
    on_moved: str = "raise",
    strict: bool = True,
    refresh: Callable[[], Any] | None = None,
    agreement: Agreeing | None = None,
    recapture: Recapture | None = None,
    around_recapture: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    expect: Iterable[str] | None = None,
) -> WeightUpdate:
    """Load ``source`` into the modules of ``targets`` (runners' doors) in place; check
    each; return what was done with the refit verdict.

    ``source``: a state dict (names as the module names them), a module of the same
    architecture (its parameters and buffers, non-persistent ones included), or a
    callable: called with no argument, it loads in place (``model.load_state_dict``),
    observed like a :func:`refit` (version counters and checksums), or returns a state
    dict or module to copy. Before anything is copied: a tensor that already moved
    (``on_moved="raise"``), and every entry of the source (one :class:`ConfigError`
    lists every problem: unknown names with the closest one, missing names, ``name:
    expected float32 [4, 4], got ...``, tied names given different values, a meta tensor
    or a FakeTensor (no data), a non-strided tensor, and a source that shares memory with
    any tensor the update writes, such as ``w.t()`` of a live weight: "pass a copy:
    source.clone()"). Nothing is copied unless every entry is valid. A source on another
    device than its destination is copied across. Tied names (one storage) are copied
    once; non-persistent buffers are copied when given, never required; ``strict=False``
    updates the names given and ignores unknown ones. The copy is one
    ``torch._foreach_copy_`` per (target device, source device) under ``no_grad``
    (``inference_mode`` for inference tensors), then a device synchronize. Targets that
    share one module get one copy. Afterwards every target is checked; a tensor the
    loader moved raises, or with ``on_moved="recapture"`` the graphs that read it are
    recaptured (``recapture``, default each door's partial recapture), each under
    ``around_recapture()`` when given. Every door's capture guard is held throughout.

    The verdict (``WeightUpdate.refit``): a weight the graphs read that the update did
    not write (``strict=False``: not given; a loader: not written) is named with the
    graphs that read it; among ``expect`` (every parameter by default) it raises
    :class:`~graphguard.errors.StaleWeightsError` unless ``strict=False``.

    Derived tensors (the graphs read them, no module lists them, e.g.
    ``self.wt = self.lin.weight.t().contiguous()`` made at load) are not written by a
    copy, so an update from a state dict that the graphs' derived reads would leave stale
    is refused before anything is copied (:func:`refuse_stale_derived`) unless
    ``refresh`` is given: ``refresh()`` runs after the copy and re-derives them, in place
    (the graphs read the new values) or at a new address (then the check finds them
    moved: ``on_moved`` decides). ``refresh=lambda: None`` says they do not depend on
    the weights.

    ``agreement`` (tensor parallelism; :class:`graphguard.serving.Agreement`): the ranks
    agree after validating (a problem on any rank raises on every rank, before any rank
    copies), on the verdict, and after checking (a moved tensor on any rank raises on
    every rank, or every rank recaptures).
    """
    t0 = time.perf_counter()
    with contextlib.ExitStack() as guards:
        for t in targets:
            guards.enter_context(t.exclusive("update_weights()"))
        captured = [t for t in targets if t.captured_sizes]
        plans, loaded, watch = _validated(
            targets, captured, source, on_moved, strict, refresh, agreement, expect
        )
        t_launch = time.perf_counter()
        copy = _copy_while_checking(captured, plans, watch, refresh, expect)
        t_settle = time.perf_counter()
        done = settle(
            copy.found,
            copy.verdict,
            on_moved=on_moved,
            strict=strict,
            agreement=agreement,
            recapture=recapture,
            around_recapture=around_recapture,
            reason="update_weights: weights moved",
        )
        return _what_was_done(done, plans, copy, loaded, t0, t_launch, t_settle)


def _validated(
    targets: Sequence[Refit],
    captured: Sequence[Refit],
    source: Any,
    on_moved: str,
    strict: bool,
    refresh: Callable[[], Any] | None,
    agreement: Agreeing | None,
    expect: Iterable[str] | None,
) -> tuple[list[CopyPlan], bool, Watch | None]:
    """Everything an update refuses before anything is written, the copy plans, and a
    loader watched before it runs (or run: it loaded in place); the ranks agree on it (a
    problem on any rank raises on every rank, before any rank copies)."""
    plans: list[CopyPlan] = []
    loaded, problem = False, None
    watch: Watch | None = None
    loader = callable(source) and not isinstance(source, (torch.nn.Module, Mapping))
    try:
        check_flags(on_moved, strict, targets)
        if not loader:
            refuse_stale_derived(captured, refresh)
        still = still_proven(captured)
        checked = on_moved == "raise" and not still
        if checked:
            check_moved_before(captured, on_moved, "Found before copying: no weight changed.")
        if captured and loader:  # watched before the loader runs
            watch = Watch(captured, expect=expect, observe=True)
        plans, loaded = prepare(targets, source, strict=strict, proven=still)
        if checked:
            remember_proven(captured)
    except Exception as exc:  # a loader's own error too: the peers must hear of it
        if agreement is None:
            raise
        problem = exc
    if agreement is not None:
        agreement.agree_update("validating", problem)
    return plans, loaded, watch


@dataclass(frozen=True)
class _Copied:
    """What the copy wrote and what was checked while the device copied."""

    nbytes: int
    found: list[tuple[Refit, WeightCheck]]
    verdict: RefitVerdict | None
    t_check: float
    """When the copies were launched and the checks began."""
    t_wait: float
    """When the checks ended and the wait for the copy began."""


def _copy_while_checking(
    captured: Sequence[Refit],
    plans: Sequence[CopyPlan],
    watch: Watch | None,
    refresh: Callable[[], Any] | None,
    expect: Iterable[str] | None,
) -> _Copied:
    """Launch the fused copies, then (``refresh()`` first) check every runner and make the
    verdict on the host while the device copies; then wait for the copy."""
    try:
        nbytes = sum(launch_copy(p) for p in plans)
        t_check = time.perf_counter()
        if refresh is not None:
            refresh()
        found = [(t, t.check_weights()) for t in captured]  # while the device copies
        checks = [f for _, f in found]
        verdict: RefitVerdict | None
        if watch is not None:
            verdict = watch.verdict(checks, refreshed=refresh is not None)
        elif captured:  # what the copy wrote is known: host work only
            verdict = _copy_verdict(captured, plans, checks, expect, refresh is not None)
        else:
            verdict = None
    finally:
        t_wait = time.perf_counter()
        finish_copy(plans)
    return _Copied(nbytes, found, verdict, t_check, t_wait)


def _what_was_done(
    done: WeightUpdate,
    plans: Sequence[CopyPlan],
    copy: _Copied,
    loaded: bool,
    t0: float,
    t_launch: float,
    t_settle: float,
) -> WeightUpdate:
    """The settled update with what was copied and where the time went."""
    return dataclasses.replace(
        done,
        copied=tuple(n for p in plans for n in p.names),
        bytes=copy.nbytes,
        seconds=time.perf_counter() - t0,
        ignored=tuple(n for p in plans for n in p.ignored),
        missing=tuple(n for p in plans for n in p.missing),
        loaded_by_callable=loaded,
        phases={
            "validate": t_launch - t0,
            "launch": copy.t_check - t_launch,
            "check": copy.t_wait - copy.t_check,
            "wait": t_settle - copy.t_wait,
            "settle": time.perf_counter() - t_settle,
        },
    )


def _copy_verdict(
    captured: Sequence[Refit],
    plans: Sequence[CopyPlan],
    found: Sequence[WeightCheck],
    expect: Iterable[str] | None,
    refreshed: bool,
) -> RefitVerdict:
    """The verdict of an update from what it copied; the same as the last update's while
    the plan, the graphs' reads and records are the same objects and nothing moved (an RL
    loop's updates: the verdict costs nothing after the first)."""
    reads = [t.refit_reads() for t in captured]
    key = (
        *(r.named for r in reads),
        *(x for r in reads for x in r.records),
        *(p.dsts for p in plans),
        None if expect is None else tuple(expect),
        refreshed,
    )
    room = captured[0].weights
    moved = any(f.moved for f in found)
    got = room.cache.get("verdict")
    if got is not None and not moved and _same_key(got[0], key):
        verdict: RefitVerdict = got[1]
        return verdict
    watch = Watch(captured, expect=expect, observe=False, reads=reads)
    verdict = watch.verdict(found, copied=plans, refreshed=refreshed)
    if not moved:
        room.cache["verdict"] = (key, verdict)
    return verdict


def _same_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """The same objects (identity: reads and plans are never compared by value), the same
    flags and names (equality)."""
    return len(a) == len(b) and all(
        x is y or (isinstance(x, (tuple, bool)) and x == y) for x, y in zip(a, b)
    )


def refit(
    targets: Sequence[Refit],
    *,
    expect: Iterable[str] | None = None,
    strict: bool = True,
    on_moved: str = "raise",
    refresh: Callable[[], Any] | None = None,
    agreement: Agreeing | None = None,
    recapture: Recapture | None = None,
    around_recapture: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    after: Callable[[], None] | None = None,
) -> RefitContext:
    """``with refit(doors): loader()`` (see :meth:`graphguard.GraphRunner.refit`): on
    entry the runners' guards are taken, a tensor that already moved raises
    (``on_moved="raise"``: the loader is not blamed for it), and every tensor the graphs
    read is watched (version counter, checksum); on exit ``refresh()`` runs when given,
    every one is classified (:class:`~graphguard.weights.refit.RefitVerdict`), stale
    ones raise (``strict``), moved ones raise or are recaptured (``on_moved``), and
    ``after()`` runs (an engine dropping its prefix cache). A block that raises is not
    judged (its error propagates; the ranks hear of it)."""
    guards = contextlib.ExitStack()
    t0 = time.perf_counter()
    if expect is not None and isinstance(expect, str):
        raise ConfigError(f"expect= takes names (a list), got the string {expect!r}")
    steps = _RefitSteps(
        targets,
        expect,
        strict,
        on_moved,
        refresh,
        agreement,
        recapture,
        around_recapture,
        after,
        guards,
        t0,
    )
    return RefitContext(steps.begin, steps.end, guards.close)


@dataclass(frozen=True)
class _RefitSteps:
    """A refit's options and its two steps: as the block begins, and as it ends."""

    targets: Sequence[Refit]
    expect: Iterable[str] | None
    strict: bool
    on_moved: str
    refresh: Callable[[], Any] | None
    agreement: Agreeing | None
    recapture: Recapture | None
    around_recapture: Callable[[], contextlib.AbstractContextManager[Any]] | None
    after: Callable[[], None] | None
    guards: contextlib.ExitStack
    t0: float

    def begin(self) -> Watch:
        """Take the runners' guards, refuse bad flags and what already moved, and watch
        every tensor the graphs read; the ranks agree on it."""
        for t in self.targets:
            self.guards.enter_context(t.exclusive("refit()"))
        problem: BaseException | None = None
        watch: Watch | None = None
        try:
            check_flags(self.on_moved, self.strict, self.targets)
            if self.refresh is not None and not callable(self.refresh):
                raise ConfigError(f"refresh must be a callable, got {type(self.refresh).__name__}")
            captured = [t for t in self.targets if t.captured_sizes]
            if self.on_moved == "raise":
                check_moved_before(
                    captured, self.on_moved, "Found as the refit began: the loader did not move it."
                )
            watch = Watch(captured, expect=self.expect, observe=True)
        except Exception as exc:
            if self.agreement is None:
                raise
            problem = exc
        if self.agreement is not None:
            self.agreement.agree_update("validating", problem)
        assert watch is not None  # else raised above
        return watch

    def end(self, watch: Watch, error: BaseException | None) -> WeightUpdate | None:
        """Judge the block (not one that raised: its error propagates, the peers hear of
        it): ``refresh()``, the verdict, then what moved and what is stale settled."""
        agreement, after = self.agreement, self.after
        if error is not None:  # the block's error propagates; the peers hear of it
            try:
                if agreement is not None:
                    agreement.agree_update("loading", error, fail=False)
            finally:
                if after is not None:
                    after()
            return None
        if agreement is not None:  # a loader's failure on any rank refuses every rank's
            agreement.agree_update("loading", None)
        if self.refresh is not None:
            self.refresh()
        captured = [t for t in self.targets if t.captured_sizes]
        found = [(t, t.check_weights()) for t in captured]
        verdict = watch.verdict([f for _, f in found], refreshed=self.refresh is not None)
        try:
            done = settle(
                found,
                verdict,
                on_moved=self.on_moved,
                strict=self.strict,
                agreement=agreement,
                recapture=self.recapture,
                around_recapture=self.around_recapture,
                reason="refit: weights moved",
            )
        finally:
            if after is not None:
                after()
        return dataclasses.replace(
            done, loaded_by_callable=True, seconds=time.perf_counter() - self.t0
        )


__all__ = [
    "ON_MOVED",
    "Agreeing",
    "Recapture",
    "Refit",
    "WeightUpdate",
    "check_on_moved",
    "plans_for",
    "prepare",
    "refit",
    "refuse_stale_derived",
    "settle",
    "update_weights",
]
