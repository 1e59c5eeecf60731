"""Capture-unsafe calls during warmups and capture: host syncs and host reads of device values.

A dispatch mode (thread-local, like every ``TorchDispatchMode``) flags the ops that
synchronize the host or read a device value on the CPU (``.item()``, ``nonzero``,
boolean-mask indexing, copies to or from the host...) with the op and the user's
``file:line``. An explicit ``torch.cuda.synchronize()`` is no op, so it is caught by
:func:`explicit_syncs_raise`, which raises only on the warming thread (see there).

Where a host read is refused: in the capture, not in a warmup (decided for issue 29).
The op check runs in both (:class:`WarmupMonitor`, and the capture's
:class:`~graphguard.sanitizer.storages.CaptureRecorder`), but only the capture's finding
raises. What a host read can break is the graph: inside the capture it either fails the
capture (a sync is not capturable) or bakes the value seen at capture time into a
replayed kernel. A warmup is an ordinary eager forward, uncaptured; the lifecycle
synchronizes after it anyway, so a sync or host read there costs time and breaks
nothing, and nothing it reads is in any graph: the graph holds only what the capture
itself recorded. Code that reads the host only when not capturing (cuDNN's RNN dropout
state set up once, in training mode; a step that checks ``phase.is_capturing()`` or
``torch.cuda.is_current_stream_capturing()``) captures and replays correctly, so
refusing it would be a false positive, which the sanitizer promises not to make. A read
that also happens in the capture is still refused, by op and ``file:line``, as "found
during the capture of size N", before the op runs (the dispatch mode sees it first; the
capture is then aborted and unwound as for any failure). A warmup-only read is logged
at DEBUG. Not a host-read hazard and not judged here: Python state that a warmup
initialises lazily (a number cached on first call) comes from the warmup's inputs, as
eager's would come from its first call's. An explicit ``synchronize()`` is still
refused in a warmup (:func:`explicit_syncs_raise`): it is no ATen op, so the capture's
dispatch mode cannot see it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard._sites import user_site, user_site_of_traceback
from graphguard.errors import CaptureUnsafeOpError, SanitizerError
from graphguard.sanitizer._common import op_name, tensors

logger = logging.getLogger("graphguard")

_SYNC_OPS: dict[str, str] = {
    "_local_scalar_dense": "reads a device value on the host (.item(), int(), float(), "
    "bool(), or a Python `if` on a tensor)",
    "item": "reads a device value on the host (.item())",
    "is_nonzero": "reads a device value on the host (bool() of a tensor)",
    "equal": "compares tensors on the host (torch.equal returns a Python bool)",
    "allclose": "compares tensors on the host (torch.allclose returns a Python bool)",
    "nonzero": "has a data-dependent output shape, so the host waits for the device",
    "masked_select": "has a data-dependent output shape, so the host waits for the device",
    "unique": "has a data-dependent output shape, so the host waits for the device",
    "_unique": "has a data-dependent output shape, so the host waits for the device",
    "_unique2": "has a data-dependent output shape, so the host waits for the device",
    "unique_dim": "has a data-dependent output shape, so the host waits for the device",
    "unique_consecutive": "has a data-dependent output shape, so the host waits for the device",
    "bincount": "sizes its output from the data, so the host waits for the device",
    "histc": "reads min/max on the host",
}
_MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPY_OPS = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"})

_FIX = (
    "A CUDA graph cannot capture host synchronizations or host reads of device "
    "values (capture fails with an opaque CUDA error, or the graph bakes in the "
    "value seen at capture time). To fix: keep the value on the device (torch.where "
    "instead of a Python `if`, masks instead of nonzero/boolean indexing, "
    "repeat_interleave(output_size=...)), move host logic out of the captured "
    "callable, or run this step eagerly."
)
_SYNC_FIX = (
    "A CUDA graph cannot capture a host synchronization (capture fails with an opaque "
    "CUDA error). To fix: remove it from the captured callable (graphguard synchronizes "
    "between warmups and capture itself), or run this step eagerly."
)


def unsafe_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dev: str) -> str | None:
    """Why ``func`` cannot be captured on device type ``dev`` (None when it can)."""
    if getattr(func, "namespace", None) != "aten":
        return None
    name = func.overloadpacket.__name__
    reason = _SYNC_OPS.get(name)
    if reason is not None:
        touches = any(t.device.type == dev for t in tensors((args, kwargs)))
        return reason if touches else None
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        if any(t.device.type == dev for t in tensors((args, kwargs))):
            return "sizes its output from the data (pass output_size=) so the host waits"
        return None
    if name in _MASK_INDEX_OPS and len(args) > 1:
        for idx in tensors(args[1]):
            if idx.dtype in (torch.bool, torch.uint8) and idx.device.type == dev:
                return "indexes with a boolean mask, which calls nonzero (the host waits)"
        return None
    if name in _COPY_OPS and dev != "cpu":
        devices = {t.device.type for t in tensors((args, kwargs))}
        target = kwargs.get("device")
        if target is not None:
            devices.add(torch.device(target).type)
        if "cpu" in devices and dev in devices:
            return (
                "copies between host and device memory: device-to-host waits for the "
                "device, and a host-to-device copy inside a graph replays the host value "
                "of capture time"
            )
    return None


class Watched(Protocol):
    """What the dispatch modes need of the runner's sanitizer
    (:class:`~graphguard.sanitizer.checks.Sanitizer`)."""

    label: str

    def note_stream(self, func: Any, size: int) -> None: ...


class OpGuard(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Base of the sanitizer's dispatch modes: raises on capture-unsafe ops."""

    when = ""

    def __init__(self, watched: Watched, size: int, dev: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.watched = watched
        self.size = size
        self.dev = dev

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        reason = unsafe_reason(func, args, kwargs, self.dev)
        if reason is not None:
            raise CaptureUnsafeOpError(
                f"{self.watched.label}: {op_name(func)} at {user_site()} {reason}; found "
                f"during {self.when} of size {self.size}. {_FIX}"
            )


class WarmupMonitor(OpGuard):  # type: ignore[no-untyped-call]
    """Active during uncaptured warmup forwards: notes the streams used, and the
    capture-unsafe ops seen (``seen``: op, site, reason), without raising: a host read
    in a warmup is allowed, one in the capture is refused (see the module doc)."""

    when = "an uncaptured warmup"

    def __init__(self, watched: Watched, size: int, dev: str) -> None:
        super().__init__(watched, size, dev)
        self.cuda = dev == "cuda" and torch.cuda.is_available()
        self.seen: list[tuple[str, str, str]] = []

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        reason = unsafe_reason(func, args, kwargs, self.dev)
        if reason is None:
            return
        found = (op_name(func), user_site(), reason)
        if found not in self.seen:
            self.seen.append(found)
            logger.debug(
                "%s: %s at %s %s, in an uncaptured warmup of size %d: allowed there (the "
                "capture refuses it if it does the same)",
                self.watched.label,
                found[0],
                found[1],
                reason,
                self.size,
            )

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.check(func, args, kwargs)
        if self.cuda:
            self.watched.note_stream(func, self.size)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- explicit syncs

_armed = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_saved: list[tuple[Any, str, Any]] = []


def _sync_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, display name) of the explicit host-sync entry points."""
    out: list[tuple[Any, str, str]] = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize()"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize()"),
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize()"),
    ]
    accel = getattr(torch, "accelerator", None)
    if accel is not None and callable(getattr(accel, "synchronize", None)):
        out.append((accel, "synchronize", "torch.accelerator.synchronize()"))
    return out


def _guarded(original: Any, display: str) -> Callable[..., Any]:
    def synchronize(*args: Any, **kwargs: Any) -> Any:
        refuse: Callable[[str], None] | None = getattr(_armed, "refuse", None)
        if refuse is not None:
            refuse(display)
        return original(*args, **kwargs)

    synchronize.__wrapped__ = original  # type: ignore[attr-defined]
    synchronize.__doc__ = getattr(original, "__doc__", None)
    return synchronize


def _install() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        for target, attr, display in _sync_targets():
            original = target.__dict__.get(attr, getattr(target, attr))
            _saved.append((target, attr, original))
            setattr(target, attr, _guarded(original, display))


def _uninstall() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users > 0:
            return
        while _saved:
            target, attr, original = _saved.pop()
            setattr(target, attr, original)


@contextlib.contextmanager
def explicit_syncs_raise(owner: str, size: int) -> Iterator[None]:
    """Make explicit device synchronizations raise *on this thread* for the block.

    Why a patch: ``torch.cuda.synchronize()``, ``Stream/Event.synchronize()`` and
    ``torch.accelerator.synchronize()`` are no ATen ops, so no dispatch or function mode
    sees them, and ``torch.cuda.set_sync_debug_mode`` is process-wide (it would make a
    synchronize by *another* thread raise too). So while at least one thread is in a
    sanitized warmup those four entry points are replaced (installed once, reference
    counted, restored when the last warming thread leaves) by wrappers that check a
    thread-local flag: on the warming thread they raise
    :class:`CaptureUnsafeOpError`; on every other thread they call the original
    unchanged. graphguard's own synchronize after each warmup runs outside the block.
    """

    def refuse(display: str) -> None:
        raise CaptureUnsafeOpError(
            f"{owner}: {display} at {user_site()} synchronizes the host; found during an "
            f"uncaptured warmup of size {size}. {_SYNC_FIX}"
        )

    prev = getattr(_armed, "refuse", None)
    _install()
    _armed.refuse = refuse
    try:
        yield
    finally:
        _armed.refuse = prev
        _uninstall()


def as_unsafe_sync(exc: BaseException, owner: str, size: int, when: str) -> BaseException:
    """Torch's sync-debug error ("called a synchronizing CUDA operation") as a
    :class:`CaptureUnsafeOpError` naming the user's line; other errors unchanged."""
    if isinstance(exc, SanitizerError) or not isinstance(exc, RuntimeError):
        return exc
    text = str(exc)
    site = user_site_of_traceback(exc.__traceback__)
    if "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in text:
        # torch's own refusal at capture time: a host<->device copy the warmup's op
        # check did not see (e.g. issued below the dispatcher).
        return CaptureUnsafeOpError(
            f"{owner}: the callable synchronized the host with a copy between host and "
            f"device memory (aten._to_copy / copy_: .cpu(), .to('cpu'), a CPU tensor "
            f"copied in) at {site} during {when} of size {size}. A device-to-host copy "
            "waits for the device, and a host-to-device copy inside a graph replays the "
            "host value of capture time. To fix: keep the value on the device (or copy "
            "from pinned memory with non_blocking=True), or run this step eagerly."
        )
    if "synchronizing CUDA operation" not in text:
        return exc
    return CaptureUnsafeOpError(
        f"{owner}: the callable synchronized the host at {site} during {when} of size "
        f"{size} ({str(exc).strip()}). A CUDA graph cannot capture a host synchronization "
        "(torch.cuda.synchronize(), stream/event synchronize, a blocking copy). To fix: "
        "remove it from the captured callable (graphguard synchronizes between warmups "
        "and capture itself), or run this step eagerly."
    )


__all__ = ["OpGuard", "WarmupMonitor", "as_unsafe_sync", "explicit_syncs_raise", "unsafe_reason"]
