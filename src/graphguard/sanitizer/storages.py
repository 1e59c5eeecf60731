"""Freed, moved and rebound storages: what a captured graph uses but does not own.

While each size is captured, :class:`CaptureRecorder` records every storage the
captured work reads or writes that was not produced inside that capture (parameters,
KV caches, arenas, static buffers) as a weak reference plus its address and size.
Before each replay, a storage that was freed, resized or moved since is a
:class:`~graphguard.errors.FreedStorageError`; a named slot (``module.weight``, a dict
entry) that now holds another tensor while the old one lives on elsewhere is a
:class:`~graphguard.errors.ReboundTensorError`. Both name the tensor and the fix.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphguard._sites import user_site
from graphguard.sanitizer._common import (
    FROM_WEAK,
    describe_tensor,
    expired,
    op_name,
    storage,
    tensors,
    weak,
)
from graphguard.sanitizer.names import Binding, Names
from graphguard.sanitizer.unsafe import OpGuard, Watched


@dataclass
class TrackedStorage:
    """A storage a captured graph uses but does not own, as it was at capture time."""

    ref: StorageWeakRef
    data_ptr: int
    nbytes: int
    name: str | None
    tensor: str
    """The first tensor seen on it: dtype, shape and bytes."""
    op: str
    """The first op of the capture that touched it."""
    site: str
    """Where that op was called (the user's ``file:line``)."""

    def problem(self) -> str | None:
        """What changed since capture (``None``: still the same memory)."""
        if expired(self.ref):
            return "freed"
        if FROM_WEAK is None:
            return None
        st = FROM_WEAK(self.ref.cdata)
        if st is None:
            return "freed"
        nbytes, ptr = int(st.nbytes()), int(st.data_ptr())
        del st
        if nbytes != self.nbytes:
            moved = f", moved to {ptr:#x}" if ptr != self.data_ptr else ""
            return f"resized from {self.nbytes} to {nbytes} bytes{moved}"
        if ptr != self.data_ptr:
            return f"moved from {self.data_ptr:#x} to {ptr:#x}"
        return None

    def describe(self) -> str:
        who = self.name or "unnamed tensor"
        where = f", first used by {self.op} at {self.site}" if self.op else ""
        return f"{who}: {self.tensor}, storage of {self.nbytes} bytes at {self.data_ptr:#x}{where}"


def track(t: torch.Tensor, name: str | None, op: str = "", site: str = "") -> TrackedStorage | None:
    """A :class:`TrackedStorage` of ``t``'s storage as it is now (None without one)."""
    st = storage(t)
    if st is None:
        return None
    try:
        ptr, nbytes = int(st.data_ptr()), int(st.nbytes())
    except RuntimeError:
        return None
    return TrackedStorage(
        ref=weak(st),
        data_ptr=ptr,
        nbytes=nbytes,
        name=name,
        tensor=describe_tensor(t),
        op=op,
        site=site,
    )


class CaptureRecorder(OpGuard):  # type: ignore[no-untyped-call]
    """Active during one captured forward: records the storages it uses but does not own.

    A storage first seen as an *input* of an op is external (it existed before the
    capture); one first seen as an op's *output* was produced inside the capture (from
    the graph pool). Weak references to both are held until the forward ends, so no
    storage address can be reused under us meanwhile.
    """

    when = "the capture"

    def __init__(self, watched: Watched, size: int, dev: str, names: Names) -> None:
        super().__init__(watched, size, dev)
        self.names = names
        self.external: dict[int, TrackedStorage] = {}
        self._produced: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.check(func, args, kwargs)
        for t in tensors((args, kwargs)):
            self._see_input(t, func)
        out = func(*args, **kwargs)
        for t in tensors(out):
            if t.device.type != self.dev:
                continue
            st = storage(t)
            if st is not None:
                key = st._cdata
                if key not in self.external and key not in self._produced:
                    self._produced[key] = weak(st)
        return out

    def _see_input(self, t: torch.Tensor, func: Any) -> None:
        if t.device.type != self.dev:
            return
        st = storage(t)
        if st is None:
            return
        key = st._cdata
        if key in self.external or key in self._produced:
            return
        ptr = 0
        with contextlib.suppress(RuntimeError):
            ptr = int(st.data_ptr())
        tracked = track(t, self.names.by_ptr.get(ptr), op_name(func), user_site())
        if tracked is not None:
            self.external[key] = tracked

    def finish(self) -> list[TrackedStorage]:
        self._produced.clear()
        return list(self.external.values())


def bindings_for(tracked: list[TrackedStorage], names: Names) -> list[Binding]:
    """The named slots of the storages a graph uses (what the rebinding check reads)."""
    out: list[Binding] = []
    for t in tracked:
        out.extend(names.bindings.get(t.data_ptr, ()))
    return out


def freed_message(owner: str, size: int, problems: list[tuple[TrackedStorage, str]]) -> str:
    lines = "\n".join(f"  - {t.describe()}: {p}" for t, p in problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return (
        f"{owner}: the size-{size} graph captured the raw address of "
        f"{len(problems)} storage(s) that have since been freed, resized or moved; "
        "replaying it would read or write memory it no longer owns (silent "
        "corruption, or an illegal memory access much later):\n"
        f"{lines}{more}\n"
        "Nothing was replayed. To fix: keep every tensor a graph uses alive at the same "
        "address while the graphs exist -- size arenas and caches before capture (a "
        "before_capture warmup at realistic shapes, Workspace.reserve), lock them "
        "(GraphRunner(workspaces=[...])), and never reassign, resize or free them "
        "after capture. If the change is deliberate (weights reloaded, cache resized), "
        "call runner.recapture(reason=...)."
    )


def rebound_message(owner: str, size: int, rebound: list[Binding]) -> str:
    first = rebound[0].path
    others = sorted({b.path for b in rebound[1:]} - {first})
    more = f" (and {', '.join(others[:10])})" if others else ""
    return (
        f"{owner}: {first}{more} was rebound after capture; the size-{size} graph still "
        "reads the old tensor (still alive elsewhere, so nothing was freed) and would "
        "silently use its old values. Nothing was replayed. To fix: update weights in "
        "place (with torch.no_grad(): param.copy_(new)) so the captured address keeps "
        "serving, or call runner.recapture(reason=...) after rebinding."
    )


__all__ = ["CaptureRecorder", "TrackedStorage", "bindings_for", "track"]
