"""Weight updates into live graphs: validated first, one fused copy, then checked.

:func:`update_weights` (all or nothing), :func:`recapture_moved` (only the graphs that
read a moved tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphguard.errors import ConfigError, WeightsMovedError
from graphguard.weights.record import (
    GraphKey,
    MovedWeight,
    WeightCheck,
    Weights,
    dtype_name,
    named_tensors,
)

logger = logging.getLogger("graphguard")

ON_MOVED: tuple[str, ...] = ("raise", "recapture")

# ------------------------------------------------------------------ the update


@dataclass(frozen=True)
class WeightUpdate:
    """What :meth:`update_weights` did."""

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
    """The source was a callable that loaded in place (graphguard then only checked)."""
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
        return text


@dataclass
class _Copy:
    """A validated update of one module: pairs to copy, nothing applied yet."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    names: list[str]
    ignored: list[str]
    missing: list[str]


def _source_tensors(source: Any, where: str) -> dict[str, Any]:
    if isinstance(source, torch.nn.Module):
        return {name: t for name, _, _, _, _, t in named_tensors(source)}
    if isinstance(source, Mapping):
        return dict(source)
    raise ConfigError(
        f"{where}: update_weights needs a state dict (name -> tensor, names as the module "
        f"names them), a module of the same architecture or a callable that loads; got "
        f"{type(source).__name__}"
    )


def plan_copy(module: torch.nn.Module, source: Any, *, strict: bool, where: str) -> _Copy:
    """Validate ``source`` against ``module`` completely; raise one ConfigError listing
    every problem, having changed nothing."""
    plan, problems = _plan(module, source, strict=strict, where=where)
    problems += _overlaps([plan])
    _refuse(problems, where)
    return plan


def _plan(
    module: torch.nn.Module, source: Any, *, strict: bool, where: str
) -> tuple[_Copy, list[str]]:
    """The pairs to copy into ``module`` and every problem found (nothing raised for a
    problem of the source's entries, nothing copied)."""
    given = _source_tensors(source, where)
    groups: dict[tuple[Any, ...], list[tuple[str, torch.Tensor, bool]]] = {}
    for name, _, _, _, persistent, t in named_tensors(module):
        # Tied = one storage view; empty tensors all sit at address 0 and are not tied.
        ptr = t.data_ptr() or -id(t)
        key = (ptr, t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
        groups.setdefault(key, []).append((name, t, persistent))
    known = {n for members in groups.values() for n, _, _ in members}
    problems: list[str] = []
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    names: list[str] = []
    missing: list[str] = []
    for members in groups.values():
        present = [(n, t) for n, t, _ in members if n in given]
        if not present:
            if any(p for _, _, p in members):
                missing.append(members[0][0])
            continue
        name, dst = present[0]
        src = given[name]
        bad = _mismatch(name, dst, src)
        if bad:
            problems.append(bad)
            continue
        for other, _ in present[1:]:
            alt = given[other]
            same = alt is src or (isinstance(alt, torch.Tensor) and _same_tensor(alt, src))
            if same:
                continue
            alt_bad = _mismatch(other, dst, alt)
            if alt_bad:
                problems.append(alt_bad)
            elif not torch.equal(alt.to(src.device), src):
                problems.append(
                    f"{name} and {other} are tied (one storage in the module), but the source "
                    "gives them different values: give one of them, or the same tensor for both"
                )
        if _same_tensor(src, dst):
            continue  # the source is the captured storage itself
        dsts.append(dst)
        srcs.append(src)
        names.append(name)
    unknown = sorted(set(given) - known)
    if strict and unknown:
        hints = [
            n
            + (
                f" (did you mean {c[0]!r}?)"
                if (c := difflib.get_close_matches(n, known, 1))
                else ""
            )
            for n in unknown[:10]
        ]
        problems.append(
            f"{len(unknown)} name(s) the module does not have: {', '.join(hints)}"
            + (" ..." if len(unknown) > 10 else "")
        )
    if strict and missing:
        problems.append(
            f"{len(missing)} parameter(s)/buffer(s) the source does not give: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
        )
    return _Copy(dsts, srcs, names, unknown, missing), problems


def _refuse(problems: Sequence[str], where: str) -> None:
    if problems:
        raise ConfigError(
            f"{where}: update_weights refused, no weight changed:\n  - "
            + "\n  - ".join(problems)
            + "\nGive every name with the module's shape and dtype (cast with .to(dtype)), "
            "as materialized tensors that share no memory with the module's weights, "
            "or pass strict=False to update a subset and ignore unknown names."
        )


def _span(t: torch.Tensor) -> tuple[torch.device, int, int]:
    """The device and byte range ``[start, end)`` that ``t``'s elements lie in (a
    strided view counts the gaps between its elements: conservative)."""
    start = int(t.data_ptr())
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.device, start, start + extent * t.element_size()


def _overlaps(plans: Sequence[_Copy]) -> list[str]:
    """Every source that shares memory with a tensor the update writes (in any of
    ``plans``): the copy would read values already overwritten, or write what it reads.

    Refused, naming both tensors; the caller passes ``source.clone()``. (A source that is
    the destination itself, same address and layout, is no copy and never gets here.)
    """
    written = [(_span(d), n) for p in plans for d, n in zip(p.dsts, p.names) if d.numel() > 0]
    problems: list[str] = []
    for p in plans:
        for s, n in zip(p.srcs, p.names):
            if s.numel() == 0:
                continue
            dev, lo, hi = _span(s)
            for (ddev, dlo, dhi), dn in written:
                if ddev == dev and lo < dhi and dlo < hi:
                    what = "its own destination" if dn == n else f"the module's {dn}"
                    problems.append(
                        f"{n}: the source shares memory with {what} (a view or alias of a "
                        f"live weight, e.g. {dn}.t() or a slice of it), which this update "
                        f"overwrites: pass a copy: source.clone()"
                    )
                    break
    return problems


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (imported only when torch already did: none exists before)."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(t, fake.FakeTensor)


def _mismatch(name: str, dst: torch.Tensor, src: Any) -> str | None:
    if not isinstance(src, torch.Tensor):
        return f"{name}: expected a tensor, got {type(src).__name__}"
    if _is_fake(src):
        return (
            f"{name}: a FakeTensor (shapes only, no data, made under FakeTensorMode): give "
            "the real tensor"
        )
    if src.is_meta or src.device.type == "meta":
        return (
            f"{name}: a meta tensor (no data, e.g. a model built on device='meta' or "
            "loaded with low_cpu_mem_usage and never materialized): give a materialized "
            "tensor (load the checkpoint, or .to_empty() and initialize)"
        )
    if src.layout != torch.strided:
        return f"{name}: a {src.layout} tensor; give a dense one (source.to_dense())"
    if src.shape != dst.shape or src.dtype != dst.dtype:
        return (
            f"{name}: expected {dtype_name(dst.dtype)} {list(dst.shape)}, got "
            f"{dtype_name(src.dtype)} {list(src.shape)}"
        )
    return None


def apply_copy(plan: _Copy) -> int:
    """Copy every pair in place (one fused copy per (source device, target device)); bytes."""
    if not plan.dsts:
        return 0
    buckets: dict[tuple[torch.device, torch.device], tuple[list[Any], list[Any]]] = {}
    for d, s in zip(plan.dsts, plan.srcs):
        dl, sl = buckets.setdefault((d.device, s.device), ([], []))
        dl.append(d)
        sl.append(s.detach())
    inference = any(d.is_inference() for d in plan.dsts)
    devices = {d.device for d in plan.dsts if d.device.type == "cuda"}
    for dev in devices:  # replays launched before the update, on any stream, finish first
        torch.cuda.synchronize(dev)
    with torch.inference_mode() if inference else torch.no_grad():
        for dl, sl in buckets.values():
            torch._foreach_copy_(dl, sl)
    for dev in devices:
        torch.cuda.synchronize(dev)  # done before the next replay, and timed honestly
    return sum(d.nbytes for d in plan.dsts)


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


def prepare(targets: Sequence[Refit], source: Any, *, strict: bool) -> tuple[list[_Copy], bool]:
    """Run a loader callable (then nothing is left to copy), or validate ``source``
    against every distinct module of ``targets``; nothing is copied yet. Every problem of
    every module (and every source sharing memory with any tensor written) is listed in
    one ConfigError."""
    rooms = _unique_rooms(targets)
    where = " / ".join(t.label for t in targets)
    if callable(source) and not isinstance(source, (torch.nn.Module, Mapping)):
        result = source()
        if not isinstance(result, (torch.nn.Module, Mapping)):
            return [], True  # it loaded in place (e.g. model.load_state_dict(sd))
        source = result
    plans: list[_Copy] = []
    problems: list[str] = []
    for r in rooms:
        plan, found = _plan(r.module, source, strict=strict, where=where)
        plans.append(plan)
        problems += found
    problems += _overlaps(plans)
    _refuse(problems, where)
    return plans, False


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
) -> WeightUpdate:
    """Load ``source`` into the modules of ``targets`` (runners' doors) in place; check
    each. The one update sequence of every runner kind: a runner's, a dispatcher's (two
    runners over one model), ``GraphedCausalLM``'s and a tensor-parallel rank's.

    ``source``: a state dict (names as the module names them), a module of the same
    architecture (its parameters and buffers, non-persistent ones included), or a
    callable: called with no argument, it loads in place (``model.load_state_dict``) and
    graphguard checks, or returns a state dict or module to copy. Before anything is
    copied: a tensor that already moved (``on_moved="raise"``), and every entry of the
    source (one :class:`ConfigError` lists every problem: unknown names with the closest
    one, missing names, ``name: expected float32 [4, 4], got ...``, tied names given
    different values, a meta tensor or a FakeTensor (no data), a non-strided tensor, and a
    source that shares memory with any tensor the update writes, such as ``w.t()`` of a
    live weight or a slice of another one: refused, naming both, "pass a copy:
    source.clone()", since the copy would read values it already overwrote). Nothing is
    copied unless every entry is valid. A source on another device than its destination
    (a CPU state dict into a CUDA model) is copied across. Tied names (one storage) are
    copied once; non-persistent buffers are copied when given, never required;
    ``strict=False`` updates the names given and ignores unknown ones. The copy is one
    ``torch._foreach_copy_`` per (target device, source device) under ``no_grad``
    (``inference_mode`` for inference tensors), then a device synchronize. Targets that
    share one module get one copy. Afterwards every target is checked; a tensor the
    loader moved raises, or with ``on_moved="recapture"`` the graphs that read it are
    recaptured (``recapture``, default each door's partial recapture), each under
    ``around_recapture()`` when given. Every door's capture guard is held throughout.

    Derived tensors (provenance: the graphs read them, no module lists them, e.g.
    ``self.wt = self.lin.weight.t().contiguous()`` made at load) are not written by an
    update, so one that the graphs read is refused (:func:`refuse_stale_derived`) unless
    ``refresh`` is given: ``refresh()`` runs after the copy and re-derives them, in place
    (the graphs read the new values) or at a new address (then the check finds them
    moved: ``on_moved`` decides). ``refresh=lambda: None`` says they do not depend on
    the weights.

    ``agreement`` (tensor parallelism; :class:`graphguard.serving.Agreement`): the ranks
    agree twice, after validating (a problem on any rank raises on every rank, before any
    rank copies) and after checking (a moved tensor on any rank raises on every rank, or
    every rank recaptures).
    """
    t0 = time.perf_counter()
    with contextlib.ExitStack() as guards:
        for t in targets:
            guards.enter_context(t.exclusive("update_weights()"))
        captured = [t for t in targets if t.captured_sizes]
        plans: list[_Copy] = []
        loaded, problem = False, None
        try:
            check_on_moved(on_moved)
            if not isinstance(strict, bool):
                raise ConfigError(f"strict must be True or False, got {strict!r}")
            _refuse_frozen(targets)
            refuse_stale_derived(captured, refresh)
            if on_moved == "raise":
                for t in captured:
                    before = t.check_weights()
                    if before.moved:
                        raise WeightsMovedError(
                            before.message() + "\n(Found before copying: no weight changed.)",
                            names=tuple(m.name for m in before.moved),
                        )
            plans, loaded = prepare(targets, source, strict=strict)
        except Exception as exc:  # a loader's own error too: the peers must hear of it
            if agreement is None:
                raise
            problem = exc
        if agreement is not None:
            agreement.agree_update("validating", problem)
        nbytes = sum(apply_copy(p) for p in plans)
        if refresh is not None:
            refresh()
        found = [(t, t.check_weights()) for t in captured]
        moved = [m for _, f in found for m in f.moved]
        err = next(
            (
                WeightsMovedError(
                    f.message() + "\n(The loader moved them; the graphs still read the old "
                    "storage.)",
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
        recaptured: dict[str, tuple[int, ...]] = {}
        graphs: dict[str, tuple[Any, ...]] = {}
        total: dict[str, int] = {}
        for t, f in found if redo else ():
            if not f.moved and agreement is None:
                continue
            with around_recapture() if around_recapture is not None else contextlib.nullcontext():
                reason = "update_weights: weights moved" + ("" if f.moved else " on a peer rank")
                report = (recapture or _own_recapture)(t, f, reason)
            if report is not None:
                recaptured[t.label] = tuple(sorted({k[0] for k in report.recaptured_graphs}))
                graphs[t.label] = tuple(report.recaptured_graphs)
                total[t.label] = report.graphs_total
        return WeightUpdate(
            copied=tuple(n for p in plans for n in p.names),
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            ignored=tuple(n for p in plans for n in p.ignored),
            missing=tuple(n for p in plans for n in p.missing),
            loaded_by_callable=loaded,
            moved=tuple(moved),
            recaptured=recaptured,
            recaptured_graphs=graphs,
            graphs_total=total,
        )


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
    "apply_copy",
    "check_on_moved",
    "prepare",
    "refuse_stale_derived",
    "update_weights",
]
