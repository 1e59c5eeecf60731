"""Weight updates into live graphs: validated first, one fused copy, then a verdict.

:func:`update_weights` (a state dict, a module or a loader, all or nothing) and
:func:`refit` (``with runner.refit(): loader(model)``): one sequence for every runner
kind (a runner, the dispatcher's two runners over one model, ``GraphedCausalLM``, the
continuous-batching engines, a tensor-parallel rank). Both end with the same
:class:`~graphguard.weights.refit.RefitVerdict` (:mod:`graphguard.weights.refit`):
every tensor the graphs read, moved, derived, written or not written.

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
from typing import Any, Protocol

import torch

from graphguard.errors import ConfigError, WeightsMovedError
from graphguard.weights.plan import (
    CopyPlan,
    cached_plan,
    finish_copy,
    launch_copy,
    plan_copy,
    refuse_overlaps,
)
from graphguard.weights.record import GraphKey, MovedWeight, WeightCheck, Weights
from graphguard.weights.refit import RefitContext, RefitReads, RefitVerdict, Watch

logger = logging.getLogger("graphguard")

ON_MOVED: tuple[str, ...] = ("raise", "recapture")

# ------------------------------------------------------------------ the update


@dataclass(frozen=True)
class WeightUpdate:
    """What :meth:`update_weights` (or a refit) did."""

    copied: tuple[str, ...]
    """Names whose values were copied into the captured storages (tied: the first name)."""
    bytes: int
    """Bytes copied (each tied storage once)."""
    seconds: float
    """Wall time of the whole call (validation, copies, device synchronize, checks)."""
    ignored: tuple[str, ...] = ()
    """Source names not in the module (``strict=False`` only)."""
    missing: tuple[str, ...] = ()
    """Module names the source did not give (``strict=False`` only; non-persistent
    buffers are never required)."""
    loaded_by_callable: bool = False
    """The source was a callable that loaded in place (graphguard then observed it)."""
    moved: tuple[MovedWeight, ...] = ()
    """What had moved (by the loader, or before the call) and was recaptured."""
    recaptured: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per runner label (``GraphRunner(step)``), the sizes recaptured (``on_moved="recapture"``)."""
    recaptured_graphs: dict[str, tuple[GraphKey, ...]] = dataclasses.field(default_factory=dict)
    """Per runner label, the graphs recaptured, ``(size, piece)`` (piece None: a FULL
    graph): with provenance a PIECEWISE runner redoes only the pieces that read what moved."""
    graphs_total: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per runner label that recaptured, the graphs it held (FULL: one per size;
    PIECEWISE: one per piece and size)."""
    refit: RefitVerdict | None = None
    """Every tensor the graphs read, classified (None: no graph captured yet)."""
    versions_checked: tuple[str, ...] = ()
    """Names of the module whose version counters were read just before and just after
    the copy was launched (a weight sync: every name whose tensor the copy writes, tied
    names included); empty when not counted (``update_weights``, inference tensors)."""
    versions_unchanged: tuple[str, ...] = ()
    """Of :attr:`versions_checked`, those whose counter did not advance by the writes the
    copy makes to it: not written by this call."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where :attr:`seconds` went (``update_weights``): ``validate`` (host work before the
    copy is launched: the source checked, the kept plan and the module's tensors
    re-proved), ``launch`` (a device synchronize, then the fused copies launched),
    ``check`` (the graphs' reads checked and the verdict, on the host while the device
    copies), ``wait`` (the rest of the copy), ``settle`` (after it: what moved, the
    verdict applied). Only ``validate``, ``settle`` and any ``check`` longer than the
    copy add to the bare copy's time."""

    def summary(self) -> str:
        text = (
            f"updated {len(self.copied)} tensors ({self.bytes / 2**20:.1f} MiB) in "
            f"{self.seconds * 1e3:.2f} ms"
        )
        if self.recaptured:
            text += "; recaptured " + ", ".join(
                f"{k} {list(v)}"
                + (
                    f" ({len(self.recaptured_graphs.get(k, ()))} of {self.graphs_total[k]} graphs)"
                    if k in self.graphs_total
                    else ""
                )
                for k, v in self.recaptured.items()
            )
        if self.refit is not None and not self.refit.ok:
            text += f"; NOT OK: {len(self.refit.missing)} expected weight(s) not written"
        return text


def check_on_moved(on_moved: str) -> None:
    if on_moved not in ON_MOVED:
        raise ConfigError(
            f"on_moved must be 'raise' or 'recapture', got {on_moved!r}; 'recapture' recaptures "
            "the graphs that read a moved tensor"
        )


class Refit(Protocol):
    """What an update needs of one runner: its door (:class:`graphguard.serving.Door`)."""

    @property
    def label(self) -> str: ...

    @property
    def captured_sizes(self) -> tuple[int, ...]: ...

    @property
    def weights(self) -> Weights: ...

    @property
    def compiled(self) -> bool: ...

    def exclusive(self, what: str) -> contextlib.AbstractContextManager[None]: ...

    def check_weights(self) -> WeightCheck: ...

    def derived_reads(self) -> tuple[tuple[str, ...], list[MovedWeight]]: ...

    def recapture_moved(self, found: WeightCheck, reason: str) -> Any: ...

    def refit_reads(self) -> RefitReads: ...


Recapture = Callable[[Refit, WeightCheck, str], Any]
"""How the graphs that read a moved tensor are captured again: ``(door, found, reason) ->
report`` (default: the door's own partial recapture, :meth:`Door.recapture_moved
<graphguard.serving.Door.recapture_moved>`)."""


class Agreeing(Protocol):
    """The rank agreement an update uses (:class:`graphguard.serving.Agreement`)."""

    def agree_update(
        self, stage: str, error: BaseException | None, *, fail: bool = True
    ) -> bool: ...


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
    ``proven``: :func:`_still_proven` just held (the kept plan's tensors unchanged)."""
    if len(rooms) == 1:
        return [cached_plan(rooms[0], source, strict=strict, where=where, proven=proven)[0]]
    plans = [plan_copy(r.module, source, strict=strict, where=where) for r in rooms]
    refuse_overlaps(plans, where)
    return plans


def _checked(
    captured: Sequence[Refit], on_moved: str, when: str
) -> list[tuple[Refit, WeightCheck]]:
    """Each runner's check; with ``on_moved="raise"`` a moved tensor raises, saying when."""
    found = [(t, t.check_weights()) for t in captured]
    if on_moved == "raise":
        for _, f in found:
            if f.moved:
                raise WeightsMovedError(
                    f.message() + f"\n({when})", names=tuple(m.name for m in f.moved)
                )
    return found


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
        plans: list[CopyPlan] = []
        loaded, problem = False, None
        watch: Watch | None = None
        loader = callable(source) and not isinstance(source, (torch.nn.Module, Mapping))
        try:
            _check_flags(on_moved, strict, targets)
            if not loader:
                refuse_stale_derived(captured, refresh)
            still = _still_proven(captured)
            checked = on_moved == "raise" and not still
            if checked:
                _checked(captured, on_moved, "Found before copying: no weight changed.")
            if captured and loader:  # watched before the loader runs
                watch = Watch(captured, expect=expect, observe=True)
            plans, loaded = prepare(targets, source, strict=strict, proven=still)
            if checked:
                _proven(captured)
        except Exception as exc:  # a loader's own error too: the peers must hear of it
            if agreement is None:
                raise
            problem = exc
        if agreement is not None:
            agreement.agree_update("validating", problem)
        t_launch = time.perf_counter()
        t_check = t_wait = t_launch
        try:
            nbytes = sum(launch_copy(p) for p in plans)
            t_check = time.perf_counter()
            if refresh is not None:
                refresh()
            found = [(t, t.check_weights()) for t in captured]  # while the device copies
            checks = [f for _, f in found]
            if watch is not None:
                verdict = watch.verdict(checks, refreshed=refresh is not None)
            elif captured:  # what the copy wrote is known: host work only
                verdict = _copy_verdict(captured, plans, checks, expect, refresh is not None)
            else:
                verdict = None
        finally:
            t_wait = time.perf_counter()
            finish_copy(plans)
        t_settle = time.perf_counter()
        done = settle(
            found,
            verdict,
            on_moved=on_moved,
            strict=strict,
            agreement=agreement,
            recapture=recapture,
            around_recapture=around_recapture,
            reason="update_weights: weights moved",
        )
        return dataclasses.replace(
            done,
            copied=tuple(n for p in plans for n in p.names),
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            ignored=tuple(n for p in plans for n in p.ignored),
            missing=tuple(n for p in plans for n in p.missing),
            loaded_by_callable=loaded,
            phases={
                "validate": t_launch - t0,
                "launch": t_check - t_launch,
                "check": t_wait - t_check,
                "wait": t_settle - t_wait,
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


def _still_proven(captured: Sequence[Refit]) -> bool:
    """Whether nothing can have moved since the last update proved it did not: every
    module's tensors are the objects, addresses and shapes its kept copy plan recorded
    (:class:`~graphguard.weights.record.Identity`, microseconds), the runners hold the
    same sizes, and no derived tensor a graph reads was re-created. Then the full
    ``check_weights`` before the copy is skipped (it runs again after the copy, while the
    device copies)."""
    for t in captured:
        room = t.weights
        got, proven = room.cache.get("plan"), room.cache.get("proven")
        if got is None or proven != (id(got), t.label, t.captured_sizes):
            return False
        if not got[2].intact():
            return False
        if t.derived_reads()[1]:
            return False
    return bool(captured)


def _proven(captured: Sequence[Refit]) -> None:
    """A check before copying found nothing moved: remember it against the kept plan."""
    for t in captured:
        room = t.weights
        got = room.cache.get("plan")
        if got is not None:
            room.cache["proven"] = (id(got), t.label, t.captured_sizes)


def _check_flags(on_moved: str, strict: bool, targets: Sequence[Refit]) -> None:
    check_on_moved(on_moved)
    if not isinstance(strict, bool):
        raise ConfigError(f"strict must be True or False, got {strict!r}")
    _refuse_frozen(targets)


def settle(
    found: Sequence[tuple[Refit, WeightCheck]],
    verdict: RefitVerdict | None,
    *,
    on_moved: str,
    strict: bool,
    agreement: Agreeing | None,
    recapture: Recapture | None,
    around_recapture: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    reason: str,
) -> WeightUpdate:
    """The end of every refit: the ranks agree on what moved (it raises on every rank, or
    every rank recaptures: ``on_moved``), then on the verdict (a weight left stale on any
    rank raises on every rank with ``strict``, before any recapture: recapturing would
    not write a stale value). What was recaptured, as a :class:`WeightUpdate`."""
    moved = [m for _, f in found for m in f.moved]
    err = next(
        (
            WeightsMovedError(
                f.message() + "\n(The loader moved them; the graphs still read the old storage.)",
                names=tuple(m.name for m in f.moved),
            )
            for _, f in found
            if f.moved
        ),
        None,
    )
    if agreement is not None:
        redo = agreement.agree_update("checking", err, fail=on_moved == "raise")
    elif err is not None and on_moved == "raise":
        raise err
    else:
        redo = err is not None
    stale: BaseException | None = None
    if verdict is not None and strict:
        try:
            verdict.raise_if_stale()
        except Exception as exc:
            stale = exc
    if agreement is not None and strict:
        agreement.agree_update("verdict", stale)
    elif stale is not None:
        raise stale
    recaptured: dict[str, tuple[int, ...]] = {}
    graphs: dict[str, tuple[Any, ...]] = {}
    total: dict[str, int] = {}
    for t, f in found if redo else ():
        if not f.moved and agreement is None:
            continue
        with around_recapture() if around_recapture is not None else contextlib.nullcontext():
            why = reason + ("" if f.moved else " on a peer rank")
            report = (recapture or _own_recapture)(t, f, why)
        if report is not None:
            recaptured[t.label] = tuple(sorted({k[0] for k in report.recaptured_graphs}))
            graphs[t.label] = tuple(report.recaptured_graphs)
            total[t.label] = report.graphs_total
    return WeightUpdate(
        copied=(),
        bytes=0,
        seconds=0.0,
        moved=tuple(moved),
        recaptured=recaptured,
        recaptured_graphs=graphs,
        graphs_total=total,
        refit=verdict,
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

    def begin() -> Watch:
        for t in targets:
            guards.enter_context(t.exclusive("refit()"))
        problem: BaseException | None = None
        watch: Watch | None = None
        try:
            _check_flags(on_moved, strict, targets)
            if refresh is not None and not callable(refresh):
                raise ConfigError(f"refresh must be a callable, got {type(refresh).__name__}")
            captured = [t for t in targets if t.captured_sizes]
            if on_moved == "raise":
                _checked(
                    captured, on_moved, "Found as the refit began: the loader did not move it."
                )
            watch = Watch(captured, expect=expect, observe=True)
        except Exception as exc:
            if agreement is None:
                raise
            problem = exc
        if agreement is not None:
            agreement.agree_update("validating", problem)
        assert watch is not None  # else raised above
        return watch

    def end(watch: Watch, error: BaseException | None) -> WeightUpdate | None:
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
        if refresh is not None:
            refresh()
        captured = [t for t in targets if t.captured_sizes]
        found = [(t, t.check_weights()) for t in captured]
        verdict = watch.verdict([f for _, f in found], refreshed=refresh is not None)
        try:
            done = settle(
                found,
                verdict,
                on_moved=on_moved,
                strict=strict,
                agreement=agreement,
                recapture=recapture,
                around_recapture=around_recapture,
                reason="refit: weights moved",
            )
        finally:
            if after is not None:
                after()
        return dataclasses.replace(done, loaded_by_callable=True, seconds=time.perf_counter() - t0)

    return RefitContext(begin, end, guards.close)


def _own_recapture(target: Refit, found: WeightCheck, reason: str) -> Any:
    return target.recapture_moved(found, reason)


def refuse_stale_derived(targets: Sequence[Refit], refresh: Any) -> None:
    """Refuse, before anything is copied, an update that would leave derived tensors the
    graphs read stale (no ``refresh``); ``refresh`` must be a callable when given."""
    if refresh is not None:
        if not callable(refresh):
            raise ConfigError(
                f"refresh must be a callable that re-derives the derived tensors, got "
                f"{type(refresh).__name__}; e.g. refresh=model.rederive"
            )
        return
    for t in targets:
        derived, _ = t.derived_reads()
        if derived:
            raise ConfigError(
                f"{t.label}: update_weights refused, no weight changed: the captured graphs "
                f"read {len(derived)} tensor(s) that no module lists as a parameter or buffer "
                f"(derived at load): {', '.join(derived[:8])}"
                + (" ..." if len(derived) > 8 else "")
                + ". The update writes parameters and buffers only, so the graphs would "
                "keep serving values derived from the old weights. Pass refresh=callable "
                "that re-derives them after the copy (in place keeps the graphs; at a new "
                "address, on_moved decides), or refresh=lambda: None if they do not depend "
                "on the weights."
            )


def _refuse_frozen(targets: Sequence[Refit]) -> None:
    """Inductor's freezing folds parameters into the compiled code as constants: an
    in-place update would never reach it."""
    for t in targets:
        if t.compiled:
            frozen = getattr(getattr(torch, "_inductor", None), "config", None)
            if frozen is not None and getattr(frozen, "freezing", False):
                raise ConfigError(
                    f"{t.label}: torch._inductor.config.freezing is on, so the compiled step "
                    "baked its parameters in as constants and no in-place update reaches "
                    "them; turn freezing off, or recapture(reason=...) after loading"
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
