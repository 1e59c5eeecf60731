"""A replay's outputs compared with eager's, leaf by leaf, at a per-dtype tolerance.

Replay and eager run the same kernels, so they usually agree bitwise; the tolerance is
the slack for kernels whose reduction order depends on the launch, scaled to the dtype's
precision (integers and bools exactly). Used by :func:`graphguard.verify.verify` and the
canary (:mod:`graphguard.canary`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphguard.buffers import InputSpec, flatten
from graphguard.report import SizeCheck

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


_LOW_PRECISION = (0.125, 0.125)
"""fp8 and other narrow floats."""


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a replay with eager in ``dtype``.

    Replay and eager run the same kernels, so they usually agree bitwise; the slack is
    for kernels whose reduction order depends on the launch, scaled to the dtype's
    precision. Integers and bools must match exactly.
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        return (0.0, 0.0)
    return _TOLERANCES.get(dtype, _LOW_PRECISION)


def compare(a: Any, b: Any) -> tuple[float, float, str]:
    """(max_abs, max_rel, note) of one output leaf (replay ``a`` vs eager ``b``).

    ``max_rel`` is ``|a - b| / (|b| + atol)``: bounded where eager is near zero.
    A non-empty note means the leaves cannot be compared (shape, dtype, value).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if a is b or bool(a == b):
            return (0.0, 0.0, "")
        return (math.inf, math.inf, f"replay {a!r} vs eager {b!r}")
    if a.shape != b.shape or a.dtype != b.dtype:
        note = f"replay {a.dtype} {list(a.shape)} vs eager {b.dtype} {list(b.shape)}"
        return (math.inf, math.inf, note)
    if a.numel() == 0:
        return (0.0, 0.0, "")
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        mx = float((a.to(torch.int64) - b.to(torch.int64)).abs().max())
        return (mx, mx, "")
    atol = default_tolerance(a.dtype)[1]
    af = a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
    bf = b.to(af.dtype)
    equal = (af == bf) | (torch.isnan(af) & torch.isnan(bf))
    diff = (af - bf).abs().nan_to_num(nan=math.inf)
    diff = torch.where(equal, torch.zeros_like(diff), diff)
    rel = diff / (bf.abs().nan_to_num(nan=0.0, posinf=0.0) + max(atol, 1e-30))
    return (float(diff.max()), float(rel.max()), "")


def within(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return bool(torch.equal(a, b))
    af = a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
    bf = b.to(af.dtype)
    return bool(torch.isclose(af, bf, rtol=rtol, atol=atol, equal_nan=True).all())


def check_size(
    size: int, replay_out: Any, eager_out: Any, rtol: float | None, atol: float | None
) -> SizeCheck:
    a_leaves, _ = flatten(replay_out)
    b_leaves, _ = flatten(eager_out)
    check = SizeCheck(size=size, dtype="-", max_abs=0.0, max_rel=0.0, rtol=0.0, atol=0.0, ok=True)
    if len(a_leaves) != len(b_leaves):
        check.ok, check.note = False, f"{len(a_leaves)} outputs vs eager {len(b_leaves)}"
        check.max_abs = check.max_rel = math.inf
    for i, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        max_abs, max_rel, note = compare(a, b)
        if isinstance(a, torch.Tensor):
            r0, a0 = default_tolerance(a.dtype)
            r, t = (rtol if rtol is not None else r0), (atol if atol is not None else a0)
            leaf_ok = not note and within(a, b, r, t)
            dtype = str(a.dtype).removeprefix("torch.")
        else:
            r, t, leaf_ok, dtype = 0.0, 0.0, not note, type(a).__name__
        if check.dtype == "-" or max_abs > check.max_abs or (not leaf_ok and check.ok):
            check.dtype, check.rtol, check.atol, check.worst_leaf = dtype, r, t, i
        check.max_abs = max(check.max_abs, max_abs)
        check.max_rel = max(check.max_rel, max_rel)
        if not leaf_ok:
            check.ok = False
            check.note = check.note or (f"leaf {i}: {note}" if note else f"leaf {i}")
    return check


def check_inputs(
    check: SizeCheck,
    specs: Sequence[InputSpec],
    replayed: Sequence[Any],
    eager: Sequence[Any],
    rtol: float | None,
    atol: float | None,
) -> None:
    """The inputs as the caller sees them after each path: a step that writes its
    arguments in place must leave them as eager does (graphguard copies the rows back)."""
    for spec, a, b in zip(specs, replayed, eager):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        r0, a0 = default_tolerance(a.dtype)
        r, t = (rtol if rtol is not None else r0), (atol if atol is not None else a0)
        if a.shape != b.shape or not within(a, b, r, t):
            check.ok = False
            check.max_abs = max(check.max_abs, compare(a, b)[0])
            check.note = check.note or f"input {spec.name} after the call differs from eager's"


def has_signal(out: Any) -> bool:
    """Whether any tensor output has a nonzero element (all-zero outputs prove little)."""
    leaves, _ = flatten(out)
    return any(isinstance(t, torch.Tensor) and t.numel() > 0 and bool(t.any()) for t in leaves)


def owned(out: Any) -> Any:
    """Plain, owned copies of the replay's outputs (they alias memory the next call reuses)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone().as_subclass(torch.Tensor), out)


__all__ = [
    "check_inputs",
    "check_size",
    "compare",
    "default_tolerance",
    "has_signal",
    "owned",
    "within",
]
