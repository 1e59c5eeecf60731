"""A validated copy of new weights into a module: every entry checked first, then copied.

:func:`plan_copy` checks the whole source against the module (names, shapes, dtypes, tied
names, memory shared with a destination) and returns a :class:`CopyPlan`, or one
:class:`~graphguard.errors.ConfigError` listing every problem, having changed nothing.

**Validated once.** An RL loop pushes the same structure of tensors into the same module
after every optimizer step. :func:`cached_plan` keeps the last plan of a module and
reuses it while the source has the same names at the same addresses, shapes, strides,
dtypes, devices and types (one pass of C-speed ``map`` over the source, about 0.1 ms for
220 tensors) and the module's tree is the same, every tensor of it the same object at the
same address (:class:`~graphguard.weights.record.Identity`: a replaced submodule or a
removed parametrization ends the reuse): under those conditions every check the
plan passed would pass again, except the values of tied names given as two tensors, which
are compared again. Anything differs: a full validation, and the new plan is kept.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from graphguard.errors import ConfigError
from graphguard.weights.record import Identity, Weights, dtype_name, named_tensors


@dataclass
class CopyPlan:
    """A validated update of one module: pairs to copy, nothing applied yet."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    names: list[str]
    ignored: list[str]
    missing: list[str]
    same: list[str] = field(default_factory=list)
    """Names whose source is the destination itself (nothing to copy: already written)."""
    tied: list[tuple[str, str]] = field(default_factory=list)
    """Tied names the source gives as two tensors: their values are compared on every
    update (a cached plan re-checks them)."""
    groups: Any = None
    """The pairs by (destination, source) device, worked out at the first launch."""
    inference: bool = False
    nbytes: int = 0


def _source_tensors(source: Any, where: str) -> dict[str, Any]:
    if isinstance(source, torch.nn.Module):
        return {name: t for name, _, _, _, _, t in named_tensors(source)}
    if isinstance(source, Mapping):
        given = dict(source)
        odd = [k for k in given if not isinstance(k, str)]
        if odd:  # refused here: the unknown-name hints would compare them as names
            shown = ", ".join(f"{k!r:.40} ({type(k).__name__})" for k in odd[:5])
            raise ConfigError(
                f"{where}: update_weights refused, no weight changed: the source's keys must "
                f"be names (str), as the module names its parameters and buffers "
                f"(named_parameters()); {len(odd)} key(s) are not: {shown}"
                + (" ..." if len(odd) > 5 else "")
            )
        return given
    raise ConfigError(
        f"{where}: update_weights needs a state dict (name -> tensor, names as the module "
        f"names them), a module of the same architecture or a callable that loads; got "
        f"{type(source).__name__}"
    )


def plan_copy(module: torch.nn.Module, source: Any, *, strict: bool, where: str) -> CopyPlan:
    """Validate ``source`` against ``module`` completely; raise one ConfigError listing
    every problem, having changed nothing."""
    plan, problems = _plan(module, source, strict=strict, where=where)
    problems += _overlaps([plan])
    _refuse(problems, where)
    return plan


def _plan(
    module: torch.nn.Module, source: Any, *, strict: bool, where: str
) -> tuple[CopyPlan, list[str]]:
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
    same: list[str] = []
    tied: list[tuple[str, str]] = []
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
            if alt is src or (isinstance(alt, torch.Tensor) and _same_tensor(alt, src)):
                continue
            alt_bad = _mismatch(other, dst, alt)
            if alt_bad:
                problems.append(alt_bad)
            else:
                tied.append((name, other))
                problems += _tied_values(given, [(name, other)])
        if _same_tensor(src, dst):
            same.append(name)
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
    return CopyPlan(dsts, srcs, names, unknown, missing, same, tied), problems


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


def _overlaps(plans: Sequence[CopyPlan]) -> list[str]:
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


MEMCPY_BYTES = 1 << 20
"""Destinations this large are copied one ``copy_`` each: on a CUDA device, between
contiguous tensors of one dtype, that is a device-to-device ``cudaMemcpyAsync``, which on
the H200 moved the reference 1B step's weights 23% faster than one ``_foreach_copy_``
(1.41 vs 1.81 ms for 2.3 GiB, ``bench/probes/probe_copy.py``); the many small ones stay
one fused launch."""
MEMCPY_DEVICES = ("cuda",)
"""Device types where :data:`MEMCPY_BYTES` applies (a CPU copy gains nothing from it)."""


class _Group(NamedTuple):
    """A plan's pairs of one (destination, source) device pair, as :func:`launch_copy`
    copies them."""

    device: torch.device
    """The destinations' device (synchronized before and after)."""
    each: list[tuple[torch.Tensor, int]]
    """``(destination, source index)`` copied one ``copy_`` each (:data:`MEMCPY_BYTES`)."""
    fused: list[torch.Tensor]
    """The other destinations, one ``_foreach_copy_``."""
    fused_srcs: list[int]
    """Their source indices."""


def launch_copy(plan: CopyPlan) -> int:
    """Start copying every pair in place, without waiting: the host checks what it can
    while the device copies (:func:`finish_copy` waits). Bytes copied. Per (destination,
    source) device pair: on one CUDA device, each destination of at least
    :data:`MEMCPY_BYTES` by its own ``copy_`` and the rest in one ``_foreach_copy_``;
    across devices one ``_foreach_copy_``. What depends on the destinations only (the
    grouping, whether any is an inference tensor) is worked out once per plan and kept
    with it, so a reused plan's launch is the copies and little else."""
    if not plan.dsts:
        return 0
    groups = _grouped(plan)
    for dev in {g.device for g in groups if g.device.type == "cuda"}:
        # Replays launched before the update, on any stream, finish first: they read the
        # old weights whole (docs/serving.md).
        torch.cuda.synchronize(dev)
    srcs = plan.srcs
    with torch.inference_mode() if plan.inference else torch.no_grad():
        for g in groups:
            for dst, i in g.each:
                dst.copy_(srcs[i])
            if g.fused:
                torch._foreach_copy_(g.fused, [srcs[i] for i in g.fused_srcs])
    return plan.nbytes


def _grouped(plan: CopyPlan) -> list[_Group]:
    """The plan's pairs by (destination, source) device, each group's large destinations
    apart (:data:`MEMCPY_BYTES`), worked out once and kept."""
    if plan.groups is None:
        by: dict[tuple[torch.device, torch.device], list[int]] = {}
        for i, (d, s) in enumerate(zip(plan.dsts, plan.srcs)):
            by.setdefault((d.device, s.device), []).append(i)
        groups = []
        for (dst_dev, src_dev), idx in by.items():
            one_dev = dst_dev == src_dev and dst_dev.type in MEMCPY_DEVICES
            big = [i for i in idx if one_dev and plan.dsts[i].nbytes >= MEMCPY_BYTES]
            taken = set(big)
            rest = [i for i in idx if i not in taken]
            each = [(plan.dsts[i], i) for i in big]
            groups.append(_Group(dst_dev, each, [plan.dsts[i] for i in rest], rest))
        plan.groups = groups
        plan.inference = any(d.is_inference() for d in plan.dsts)
        plan.nbytes = sum(d.nbytes for d in plan.dsts)
    return plan.groups  # type: ignore[no-any-return]


def finish_copy(plans: Sequence[CopyPlan]) -> None:
    """Wait for the copies of ``plans`` (done before the next replay, and timed honestly)."""
    devices = {g.device for p in plans for g in p.groups or () if g.device.type == "cuda"}
    for dev in devices:
        torch.cuda.synchronize(dev)


def apply_copy(plan: CopyPlan) -> int:
    """Copy every pair in place and wait for it; bytes."""
    n = launch_copy(plan)
    finish_copy([plan])
    return n


def refuse_overlaps(plans: Sequence[CopyPlan], where: str) -> None:
    """One ConfigError for every source of ``plans`` sharing memory with a destination of
    any of them (several modules updated together)."""
    _refuse(_overlaps(plans), where)


def _tied_values(given: Mapping[str, Any], pairs: Sequence[tuple[str, str]]) -> list[str]:
    """Tied names the source gives as two tensors must hold the same values."""
    problems = []
    for name, other in pairs:
        src, alt = given[name], given[other]
        if not torch.equal(alt.to(src.device), src):
            problems.append(
                f"{name} and {other} are tied (one storage in the module), but the source "
                "gives them different values: give one of them, or the same tensor for both"
            )
    return problems


_ATTRS = tuple(operator.attrgetter(a) for a in ("shape", "dtype", "device"))
"""A non-strided layout has no ``data_ptr()``: :func:`_structure` is None for it."""


def _structure(given: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a plan's validity depends on in the source: its names and, per tensor, its
    address, shape, dtype and device (None: not all tensors, or a tensor without an
    address, such as a FakeTensor or a meta tensor). Not its stride (``copy_`` reads a
    source in any layout) nor its Python type (a Parameter and a plain tensor copy
    alike): what a repeated update re-reads before its copy launches is what it needs."""
    values = list(given.values())
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and any(issubclass(t, fake.FakeTensor) for t in set(map(type, values))):
        return None
    try:
        return (
            tuple(given),
            tuple(map(torch.Tensor.data_ptr, values)),
            *(tuple(map(get, values)) for get in _ATTRS),
        )
    except Exception:  # not a tensor, or no storage: validate in full (it names why)
        return None


def cached_plan(
    room: Weights, source: Any, *, strict: bool, where: str, proven: bool = False
) -> tuple[CopyPlan, bool]:
    """The validated plan of ``source`` into ``room``'s module (see the module docstring):
    the last one when it still holds, else a new one (kept); and whether it was reused.
    ``proven``: the caller just proved the module's tensors unchanged against the kept
    plan (not proved again). Raises the ConfigError of :func:`plan_copy` (nothing kept
    then)."""
    given = _source_tensors(source, where)
    key = (strict, _structure(given))
    got = room.cache.get("plan")
    if got is not None and key[1] is not None and got[0] == key and (proven or got[2].intact()):
        plan: CopyPlan = got[1]
        _refuse(_tied_values(given, plan.tied), where)
        again = dataclasses.replace(plan, srcs=[given[n] for n in plan.names])
        return again, True
    plan, problems = _plan(room.module, given, strict=strict, where=where)
    problems += _overlaps([plan])
    _refuse(problems, where)
    if key[1] is not None:
        _grouped(plan)
        identity = Identity(room.module)
        room.cache["plan"] = (key, plan, identity)
    return plan, False


__all__ = [
    "CopyPlan",
    "apply_copy",
    "cached_plan",
    "finish_copy",
    "launch_copy",
    "plan_copy",
    "refuse_overlaps",
]
