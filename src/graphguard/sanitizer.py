"""The sanitizer: opt-in checks that turn CUDA-graph memory hazards into immediate errors.

A captured graph holds raw device addresses. Anything that frees, moves or overwrites
memory behind its back corrupts silently or fails much later with an illegal memory
access far from the cause. ``GraphRunner(..., sanitize=True)`` (or
``GRAPHGUARD_SANITIZE=1``) builds a :class:`SanitizingGraphRunner`, which adds:

1. **Freed or moved storage** (:class:`~graphguard.errors.FreedStorageError`): while each
   size is captured, a ``TorchDispatchMode`` records every storage the captured work
   reads or writes that was not produced inside that capture (parameters, KV caches,
   arenas, static buffers) as a weak reference plus its address and size. Before each
   replay, a storage that was freed, resized or moved since is an error naming the
   tensor, the graph's size and the fix. This catches seed ``002`` (an arena that grows
   after capture) for any arena, not only :class:`graphguard.Workspace`.
2. **Stale outputs**: each call returns fresh tensors aliasing the static output memory
   through non-owning storages; at the next replay those storages are poisoned
   (``torch._C._set_storage_data_ptr_access_error_msg``, the mechanism of
   ``torch.compile``'s CUDAGraph Trees), so reading an old output raises with a message
   naming the call that overwrote it. Where that private API is missing (CPU builds),
   outputs are returned as a guard subclass whose ``__torch_function__`` raises
   :class:`~graphguard.errors.StaleOutputError` instead -- weaker: code that reaches
   the memory without a torch function (a raw ``data_ptr`` taken earlier, a NumPy view,
   a C extension) is not stopped.
3. **Busy streams at capture** (:class:`~graphguard.errors.BusyStreamError`): every
   stream that ran work during the uncaptured warmups is registered with
   :func:`graphguard.streams.register_stream`, so the idle check the lifecycle runs
   before each capture covers hand-rolled side streams too (seed ``000``).
4. **Graph vs eager divergence** (:func:`verify`, :class:`~graphguard.errors.DivergenceError`).
5. **Capture-unsafe calls** (:class:`~graphguard.errors.CaptureUnsafeOpError`): during
   the uncaptured warmups (and the capture), host synchronizations and CPU reads of
   device values (``.item()``, ``nonzero``, copies to or from the host, ``equal``,
   boolean-mask indexing...) are reported with the op and the user's ``file:line``
   before CUDA's own opaque capture error; ``torch.cuda.set_sync_debug_mode("error")``
   catches the syncs no op reveals (``torch.cuda.synchronize()`` inside the callable).

When sanitizing is off, none of this module is imported by the runner and the replay
path is the plain :meth:`GraphRunner.__call__`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard import phase, streams
from graphguard.buffers import flatten, unflatten
from graphguard.errors import (
    BusyStreamError,
    CaptureUnsafeOpError,
    ConfigError,
    DivergenceError,
    FreedStorageError,
    GraphCaptureError,
    SanitizerError,
    StaleOutputError,
)
from graphguard.phase import Phase
from graphguard.runner import GraphRunner
from graphguard.workspace import Workspace

logger = logging.getLogger("graphguard")

# ----------------------------------------------------------------------------- features

_POISON: Callable[[int, str], None] | None = getattr(
    torch._C, "_set_storage_data_ptr_access_error_msg", None
)
_ALIAS_STORAGE: Callable[[int, torch.device, int], Any] | None = getattr(
    torch._C, "_construct_storage_from_data_pointer", None
)
_FROM_WEAK: Callable[[int], Any] | None = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
_SYNC_DEBUG = callable(getattr(torch.cuda, "set_sync_debug_mode", None))


def capabilities() -> dict[str, str]:
    """What each check can do on this torch build (logged once when a sanitizer starts).

    Why it exists: the strongest checks lean on private torch APIs; a user debugging a
    hazard must know whether a check is at full strength or degraded, and why.
    """
    return {
        "stale_outputs": (
            "poisoned storages (torch._C._set_storage_data_ptr_access_error_msg)"
            if _POISON is not None and _ALIAS_STORAGE is not None
            else "guard subclass (weaker: only torch functions are stopped; private "
            "storage-poisoning API missing on this torch build)"
        ),
        "freed_storage": (
            "freed, resized and moved storages"
            if _FROM_WEAK is not None
            else "freed storages only (UntypedStorage._new_with_weak_ptr missing, so "
            "resized or moved storages are not seen)"
        ),
        "sync_debug": (
            "torch.cuda.set_sync_debug_mode('error') during warmups"
            if _SYNC_DEBUG
            else "op list only (torch.cuda.set_sync_debug_mode missing)"
        ),
    }


_logged_caps = False
_caps_lock = threading.Lock()


def _log_capabilities_once() -> None:
    global _logged_caps
    with _caps_lock:
        if _logged_caps:
            return
        _logged_caps = True
    caps = capabilities()
    logger.info(
        "graphguard sanitizer on (torch %s): %s",
        torch.__version__,
        "; ".join(f"{k}: {v}" for k, v in caps.items()),
    )


# ----------------------------------------------------------------------------- call sites

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODELS_DIR = _PKG_DIR + "models" + os.sep
_SKIP_FILES = ("contextlib.py", "functools.py", "<frozen ")


def _is_library_file(filename: str) -> bool:
    """Frames that are plumbing (torch, graphguard's library), not the user's model code.

    graphguard's reference models are user-style code and are *not* skipped.
    """
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_TORCH_DIR):
        return True
    if path.startswith(_PKG_DIR) and not path.startswith(_MODELS_DIR):
        return True
    return any(s in filename for s in _SKIP_FILES)


def _user_site(frame: FrameType | None = None) -> str:
    """``file:line (function)`` of the innermost frame outside torch and graphguard."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if not _is_library_file(f.f_code.co_filename):
            return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "<unknown>"


def _user_site_of_traceback(tb: TracebackType | None) -> str:
    """The innermost user frame of an exception's traceback (where the user's code was)."""
    site = "<unknown>"
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _is_library_file(code.co_filename):
            site = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    return site


# ----------------------------------------------------------------------------- helpers


def _weak(storage: Any) -> StorageWeakRef:
    """A weak reference to a storage (keeps the StorageImpl object, not its memory)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def _expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without one (sparse, nested...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _describe_tensor(t: torch.Tensor) -> str:
    nbytes = t.numel() * t.element_size()
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} ({nbytes} bytes)"


def _op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or str(func)
    namespace = getattr(func, "namespace", "aten")
    return f"{namespace}.{name}"


# ----------------------------------------------------------------------------- naming


class _Names:
    """Maps storage addresses to human names: static inputs, arenas, parameters, closures.

    Built at each captured forward, from what the runner knows (its specs, workspaces,
    callable), because a storage freed later can no longer tell where it came from.
    """

    _LIMIT = 256

    def __init__(self) -> None:
        self.by_ptr: dict[int, str] = {}
        self._seen: set[int] = set()

    def add_tensor(self, t: Any, name: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = _storage(t)
        if st is None:
            return
        with contextlib.suppress(RuntimeError):
            ptr = st.data_ptr()
            if ptr:
                self.by_ptr.setdefault(ptr, name)

    def scan(self, obj: Any, label: str, depth: int = 2) -> None:
        """Name the tensors reachable from ``obj`` (a few levels, bounded)."""
        if id(obj) in self._seen or len(self._seen) > 4096:
            return
        self._seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add_tensor(obj, label)
        elif isinstance(obj, Workspace):
            self.add_tensor(getattr(obj, "_buffer", None), f"workspace arena {obj.name!r}")
        elif isinstance(obj, torch.nn.Module):
            for n, p in obj.named_parameters(remove_duplicate=False):
                self.add_tensor(p, f"parameter {label}.{n}")
            for n, b in obj.named_buffers(remove_duplicate=False):
                self.add_tensor(b, f"buffer {label}.{n}")
            if depth > 0:
                for mod_name, mod in obj.named_modules():
                    for k, v in list(vars(mod).items())[: self._LIMIT]:
                        if not k.startswith("_") and isinstance(v, (torch.Tensor, Workspace)):
                            where = f"{label}.{mod_name}.{k}" if mod_name else f"{label}.{k}"
                            self.scan(v, where, 0)
        elif depth <= 0:
            return
        elif isinstance(obj, dict):
            for k, v in list(obj.items())[: self._LIMIT]:
                self.scan(v, f"{label}[{k!r}]", depth - 1)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj[: self._LIMIT]):
                self.scan(v, f"{label}[{i}]", depth - 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k, v in list(vars(obj).items())[: self._LIMIT]:
                self.scan(v, f"{label}.{k}", depth - 1)

    def scan_callable(self, fn: Any) -> None:
        """The callable's module / bound object / closure variables / partial arguments."""
        if isinstance(fn, torch.nn.Module):
            self.scan(fn, type(fn).__name__)
            return
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, type):
            self.scan(owner, type(owner).__name__)
        func = getattr(fn, "__func__", fn)
        code = getattr(func, "__code__", None)
        closure = getattr(func, "__closure__", None)
        if code is not None and closure:
            for name, cell in zip(code.co_freevars, closure):
                with contextlib.suppress(ValueError):
                    self.scan(cell.cell_contents, name)
        globs = getattr(func, "__globals__", None)
        if code is not None and isinstance(globs, dict):
            for name in code.co_names:
                value = globs.get(name)
                if isinstance(value, (torch.Tensor, torch.nn.Module, Workspace, dict, list)):
                    self.scan(value, name)
        inner = getattr(fn, "func", None)  # functools.partial
        if inner is not None and inner is not fn:
            for i, a in enumerate(getattr(fn, "args", ())):
                self.scan(a, f"partial arg {i}")
            self.scan_callable(inner)


def _runner_names(runner: GraphRunner) -> _Names:
    names = _Names()
    for spec, buf in zip(runner.specs, runner.static.buffers):
        names.add_tensor(buf, f"static input {spec.name!r}")
    for ws in runner.workspaces:
        names.scan(ws, ws.name)
    for i, leaf in enumerate(runner._set.out_leaves or ()):
        names.add_tensor(leaf, f"static output leaf {i}")
    names.scan_callable(runner.fn)
    return names


# ----------------------------------------------------------------------------- storages


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
        if _expired(self.ref):
            return "freed"
        if _FROM_WEAK is None:
            return None
        st = _FROM_WEAK(self.ref.cdata)
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


# ----------------------------------------------------------------------------- unsafe ops

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


def _unsafe_reason(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dev: str
) -> str | None:
    """Why ``func`` cannot be captured on device type ``dev`` (None when it can)."""
    if getattr(func, "namespace", None) != "aten":
        return None
    name = func.overloadpacket.__name__
    reason = _SYNC_OPS.get(name)
    if reason is not None:
        touches = any(t.device.type == dev for t in _tensors((args, kwargs)))
        return reason if touches else None
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        if any(t.device.type == dev for t in _tensors((args, kwargs))):
            return "sizes its output from the data (pass output_size=) so the host waits"
        return None
    if name in _MASK_INDEX_OPS and len(args) > 1:
        for idx in _tensors(args[1]):
            if idx.dtype in (torch.bool, torch.uint8) and idx.device.type == dev:
                return "indexes with a boolean mask, which calls nonzero (the host waits)"
        return None
    if name in _COPY_OPS and dev != "cpu":
        devices = {t.device.type for t in _tensors((args, kwargs))}
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


def _unsafe_error(owner: str, size: int, func: Any, reason: str, when: str) -> CaptureUnsafeOpError:
    site = _user_site()
    return CaptureUnsafeOpError(
        f"{owner}: {_op_name(func)} at {site} {reason}; found during {when} of size {size}. "
        "A CUDA graph cannot capture host synchronizations or host reads of device "
        "values (capture fails with an opaque CUDA error, or the graph bakes in the "
        "value seen at capture time). To fix: keep the value on the device (torch.where "
        "instead of a Python `if`, masks instead of nonzero/boolean indexing, "
        "repeat_interleave(output_size=...)), move host logic out of the captured "
        "callable, or run this step eagerly."
    )


# ----------------------------------------------------------------------------- dispatch modes


class _OpGuard(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Base of the sanitizer's dispatch modes: raises on capture-unsafe ops."""

    when = ""

    def __init__(self, runner: SanitizingGraphRunner, size: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.runner = runner
        self.size = size
        self.dev = runner.specs[0].device.type

    def _check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        reason = _unsafe_reason(func, args, kwargs, self.dev)
        if reason is not None:
            raise _unsafe_error(self.runner._owner, self.size, func, reason, self.when)


class _WarmupMonitor(_OpGuard):  # type: ignore[no-untyped-call]
    """Active during uncaptured warmup forwards: flags unsafe ops, notes the streams used."""

    when = "an uncaptured warmup"

    def __init__(self, runner: SanitizingGraphRunner, size: int) -> None:
        super().__init__(runner, size)
        self.cuda = self.dev == "cuda" and torch.cuda.is_available()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        if self.cuda:
            self.runner._note_stream(func, self.size)
        return func(*args, **kwargs)


class _CaptureRecorder(_OpGuard):  # type: ignore[no-untyped-call]
    """Active during one captured forward: records the storages it uses but does not own.

    A storage first seen as an *input* of an op is external (it existed before the
    capture); one first seen as an op's *output* was produced inside the capture (from
    the graph pool). Weak references to both are held until the forward ends, so no
    storage address can be reused under us meanwhile.
    """

    when = "the capture"

    def __init__(self, runner: SanitizingGraphRunner, size: int, names: _Names) -> None:
        super().__init__(runner, size)
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
        self._check(func, args, kwargs)
        for t in _tensors((args, kwargs)):
            self._see_input(t, func)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if t.device.type != self.dev:
                continue
            st = _storage(t)
            if st is not None:
                key = st._cdata
                if key not in self.external and key not in self._produced:
                    self._produced[key] = _weak(st)
        return out

    def _see_input(self, t: torch.Tensor, func: Any) -> None:
        if t.device.type != self.dev:
            return
        st = _storage(t)
        if st is None:
            return
        key = st._cdata
        if key in self.external or key in self._produced:
            return
        try:
            ptr, nbytes = int(st.data_ptr()), int(st.nbytes())
        except RuntimeError:
            return
        self.external[key] = TrackedStorage(
            ref=_weak(st),
            data_ptr=ptr,
            nbytes=nbytes,
            name=self.names.by_ptr.get(ptr),
            tensor=_describe_tensor(t),
            op=_op_name(func),
            site=_user_site(),
        )

    def finish(self) -> list[TrackedStorage]:
        self._produced.clear()
        return list(self.external.values())


@contextlib.contextmanager
def _sync_debug_error() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block, restored after."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


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


@contextlib.contextmanager
def _explicit_syncs_raise(owner: str, size: int) -> Iterator[None]:
    """Make explicit device synchronizations raise for the block (uncaptured warmups).

    Why patch instead of relying on ``set_sync_debug_mode``: that mode sees implicit
    syncs (blocking copies, ``.item()``), but not every torch version routes an explicit
    ``torch.cuda.synchronize()`` through it. The patch lives only for the user's
    forward; graphguard's own synchronize after each warmup runs unpatched.
    """
    saved: list[tuple[Any, str, Any]] = []

    def make(display: str) -> Callable[..., None]:
        def refuse(*_: Any, **__: Any) -> None:
            raise CaptureUnsafeOpError(
                f"{owner}: {display} at {_user_site()} synchronizes the host; found during "
                f"an uncaptured warmup of size {size}. A CUDA graph cannot capture a host "
                "synchronization (capture fails with an opaque CUDA error). To fix: remove "
                "it from the captured callable (graphguard synchronizes between warmups "
                "and capture itself), or run this step eagerly."
            )

        return refuse

    try:
        for target, attr, display in _sync_targets():
            saved.append((target, attr, target.__dict__.get(attr, getattr(target, attr))))
            setattr(target, attr, make(display))
        yield
    finally:
        for target, attr, original in reversed(saved):
            setattr(target, attr, original)


# ----------------------------------------------------------------------------- stale outputs


class _CallToken:
    """Shared by the outputs of one call; set stale when a later replay overwrites them."""

    __slots__ = ("message", "ptrs")

    def __init__(self, ptrs: frozenset[int]) -> None:
        self.ptrs = ptrs
        self.message: str | None = None


_METADATA_FUNCS = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "ndimension",
        "stride",
        "numel",
        "nelement",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "__hash__",
        "__len__",
        "__del__",
    }
)


class GuardedOutput(torch.Tensor):
    """Fallback stale-output guard where torch cannot poison storages (e.g. CPU builds).

    A plain tensor subclass sharing the output memory: every torch function on it (and
    on views made from it, which inherit the guard) first checks whether a later replay
    has overwritten the memory, and raises :class:`StaleOutputError` if so. Metadata
    (shape, dtype, strides) stays readable. Weaker than storage poisoning: a raw
    ``data_ptr`` or NumPy view taken before the next call is not stopped.
    """

    _gg_token: _CallToken | None

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        token: _CallToken | None = None
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, GuardedOutput):
                tok = leaf.__dict__.get("_gg_token")
                if tok is not None:
                    name = getattr(func, "__name__", "")
                    if tok.message is not None and name not in _METADATA_FUNCS:
                        raise StaleOutputError(tok.message)
                    token = tok
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if token is None:
                return out
            return pytree.tree_map_only(torch.Tensor, lambda r: _retag(r, token), out)


def _retag(r: torch.Tensor, token: _CallToken) -> torch.Tensor:
    """Views of guarded memory stay guarded; anything else becomes a plain tensor."""
    st = _storage(r)
    try:
        aliases = st is not None and st.data_ptr() in token.ptrs
    except RuntimeError:
        aliases = False
    if not aliases:
        return r.as_subclass(torch.Tensor) if type(r) is not torch.Tensor else r
    g = r.as_subclass(GuardedOutput)
    g.__dict__["_gg_token"] = token
    return g


# ----------------------------------------------------------------------------- the runner


class SanitizingGraphRunner(GraphRunner):
    """A :class:`GraphRunner` with every sanitizer check on (see the module docstring).

    Built by ``GraphRunner(..., sanitize=True)`` or ``GRAPHGUARD_SANITIZE=1``; a separate
    class so the plain runner's replay path carries no check at all. Slower on purpose:
    each call checks the replayed graph's storages and wraps the outputs; capture runs
    every op through a dispatch mode.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sanitize = True
        self._owner = f"GraphRunner({self.name})"
        self._tracked: dict[int, list[TrackedStorage]] = {}
        self._pending: dict[int, list[TrackedStorage]] = {}
        self._warm_streams: dict[int, Any] = {}
        self._calls = 0
        self._live: list[StorageWeakRef] = []
        self._live_token: _CallToken | None = None
        self._live_what = ""
        _log_capabilities_once()

    # ------------------------------------------------------------------ capture

    def capture(self) -> Any:
        """Capture with recording on; a sanitizer finding is raised as itself.

        The lifecycle wraps any failure of a size in :class:`GraphCaptureError`; a
        sanitizer finding (unsafe op, busy stream) is the real diagnosis, so it is
        re-raised unwrapped (the capture error stays reachable as its context).
        """
        self._pending.clear()
        self._tracked.clear()
        try:
            return super().capture()
        except GraphCaptureError as exc:
            if isinstance(exc.cause, (SanitizerError, BusyStreamError)):
                raise exc.cause from None
            raise

    def _forward(self, *views: torch.Tensor) -> Any:
        """The user's forward, watched: unsafe ops and streams in warmups, storages in capture.

        Only the user's callable runs under the dispatch modes; graphguard's own
        bookkeeping around it (input-write detection, output copies) is not inspected.
        """
        size = int(views[0].shape[self.specs[0].batch_dim]) if views else 0
        if phase.is_capturing():
            recorder = _CaptureRecorder(self, size, _runner_names(self))
            with recorder:
                out = self.fn(*views)
            tracked = recorder.finish()
            if not phase.is_profiling():
                self._pending[size] = tracked
            return out
        if phase.current_phase() is not Phase.WARMUP:
            return self.fn(*views)  # e.g. the CPU emulation replaying the body
        cuda = self.specs[0].device.type == "cuda" and torch.cuda.is_available()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(_WarmupMonitor(self, size))
                if cuda:
                    stack.enter_context(_explicit_syncs_raise(self._owner, size))
                    if _SYNC_DEBUG:
                        stack.enter_context(_sync_debug_error())
                return self.fn(*views)
        except RuntimeError as exc:
            if isinstance(exc, SanitizerError) or "synchronizing CUDA operation" not in str(exc):
                raise
            site = _user_site_of_traceback(exc.__traceback__)
            raise CaptureUnsafeOpError(
                f"{self._owner}: the callable synchronized the host at {site} during an "
                f"uncaptured warmup of size {size} ({str(exc).strip()}). A CUDA graph "
                "cannot capture a host synchronization (torch.cuda.synchronize(), "
                "stream/event synchronize, a blocking copy). To fix: remove it from the "
                "captured callable (graphguard synchronizes between warmups and capture "
                "itself), or run this step eagerly."
            ) from exc

    def _build_entries(self) -> None:
        super()._build_entries()
        names = _runner_names(self)
        extra: list[tuple[torch.Tensor, str]] = [
            (leaf, f"static output leaf {i}")
            for i, leaf in enumerate(self._set.out_leaves or ())
            if isinstance(leaf, torch.Tensor)
        ]
        for size, leaves in self._set.graph_leaves.items():
            extra += [
                (leaf, f"static output leaf {i} of size {size}")
                for i, leaf in enumerate(leaves)
                if isinstance(leaf, torch.Tensor)
            ]
        tracked: dict[int, list[TrackedStorage]] = {}
        for size in self._set.graphs:
            items = list(self._pending.get(size, ()))
            seen = {t.data_ptr for t in items}
            for leaf, label in extra:
                st = _storage(leaf)
                if st is None or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                items.append(
                    TrackedStorage(
                        ref=_weak(st),
                        data_ptr=int(st.data_ptr()),
                        nbytes=int(st.nbytes()),
                        name=names.by_ptr.get(st.data_ptr(), label),
                        tensor=_describe_tensor(leaf),
                        op="",
                        site="",
                    )
                )
            tracked[size] = items
        self._tracked = tracked
        self._pending.clear()
        counts = {s: len(v) for s, v in sorted(tracked.items())}
        if counts:
            logger.info("%s: sanitizer watches %s external storages per size", self._owner, counts)

    def _note_stream(self, func: Any, size: int) -> None:
        """Register a stream that ran work during a warmup, so capture checks it is idle."""
        stream = torch.cuda.current_stream(self.specs[0].device)
        key = int(stream.cuda_stream)
        if key in self._warm_streams:
            return
        known = {int(getattr(s, "cuda_stream", -1)) for _, s in streams.known_streams()}
        self._warm_streams[key] = stream  # keep alive: the registry holds it weakly
        if key in known:
            return
        streams.register_stream(
            f"stream {key:#x} (ran {_op_name(func)} at {_user_site()} during a warmup of "
            f"{self._owner} size {size})",
            stream,
        )

    def release(self) -> None:
        """Drop the graphs; outputs still held by the caller are poisoned (pool freed)."""
        self._invalidate(f"{self._owner}.release() freed the graphs and their memory pool")
        super().release()
        self._tracked = {}

    # ------------------------------------------------------------------ checks

    def watched_storages(self, size: int) -> list[TrackedStorage]:
        """The external storages the size-``size`` graph was seen using at capture."""
        return list(self._tracked.get(size, ()))

    def check_storages(self, sizes: Sequence[int] | None = None) -> None:
        """Raise :class:`FreedStorageError` if a graph's storages changed since capture.

        Runs automatically before each replay (for the replayed size); call it with no
        argument to check every captured size, e.g. after reloading weights.
        """
        for size in sorted(self._tracked) if sizes is None else sizes:
            problems = [(t, p) for t in self._tracked.get(size, ()) for p in [t.problem()] if p]
            if problems:
                raise FreedStorageError(self._freed_message(size, problems))

    def _freed_message(self, size: int, problems: list[tuple[TrackedStorage, str]]) -> str:
        lines = "\n".join(f"  - {t.describe()}: {p}" for t, p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        return (
            f"{self._owner}: the size-{size} graph captured the raw address of "
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

    # ------------------------------------------------------------------ replay

    def _run(self, e: Any) -> Any:
        """Both replay paths (``runner(*inputs)`` and ``replay(n)``) end here: check the
        graph's storages, replay, poison the previous outputs, guard the new ones."""
        size = int(e.size)
        self.check_storages((size,))
        out = super()._run(e)
        return self._after_replay(out, e.n, size)

    def _after_replay(self, out: Any, n: int, size: int) -> Any:
        self._calls += 1
        what = f"call #{self._calls} (batch {n}, replaying the size-{size} graph)"
        self._invalidate(f"{self._owner} {what} has since replayed into the same memory")
        if self.copy_outputs:
            return out
        return self._guard(out, what)

    def _invalidate(self, why: str) -> None:
        """Poison the outputs handed out by the previous call (if still held)."""
        if self._live_token is None and not self._live:
            return
        msg = (
            f"graphguard StaleOutputError: this tensor is an output of {self._owner} "
            f"{self._live_what}, and {why}, so its contents are overwritten. Runner "
            "outputs are views valid only until the next call: clone what you keep "
            "(out = runner(...).clone()) or build the runner with copy_outputs=True."
        )
        if self._live_token is not None:
            self._live_token.message = msg
            self._live_token = None
        if _POISON is not None:
            for ref in self._live:
                if not _expired(ref):
                    _POISON(ref.cdata, msg)
        self._live = []

    def _guard(self, out: Any, what: str) -> Any:
        leaves, spec = flatten(out)
        self._live_what = what
        if _POISON is not None and _ALIAS_STORAGE is not None:
            fresh: dict[int, Any] = {}
            new: list[Any] = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    new.append(leaf)
                    continue
                st = leaf.untyped_storage()
                ptr = int(st.data_ptr())
                alias = fresh.get(ptr)
                if alias is None:
                    alias = _ALIAS_STORAGE(ptr, leaf.device, int(st.nbytes()))
                    fresh[ptr] = alias
                    self._live.append(_weak(alias))
                t = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
                with torch.no_grad():
                    t.set_(alias, leaf.storage_offset(), leaf.shape, leaf.stride())
                new.append(t)
            return unflatten(new, spec)
        ptrs = frozenset(
            int(leaf.untyped_storage().data_ptr())
            for leaf in leaves
            if isinstance(leaf, torch.Tensor)
        )
        token = _CallToken(ptrs)
        self._live_token = token
        guarded = [
            _retag(leaf, token) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        ]
        return unflatten(guarded, spec)


# ----------------------------------------------------------------------------- verify

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


@dataclass
class SizeCheck:
    """One size of :func:`verify`: how far the replay is from eager."""

    size: int
    dtype: str
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    ok: bool
    worst_leaf: int = 0
    note: str = ""


@dataclass
class VerifyReport:
    """Every size :func:`verify` checked, as data (:meth:`to_dict`) and a :meth:`table`."""

    runner: str
    sizes: list[SizeCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sizes)

    @property
    def failed(self) -> list[int]:
        return [s.size for s in self.sizes if not s.ok]

    def table(self) -> str:
        head = f"verify {self.runner}: {len(self.sizes)} size(s), " + (
            "all match eager" if self.ok else f"{len(self.failed)} diverge {self.failed}"
        )
        rows = [
            f"{'size':>6}  {'dtype':<9} {'max_abs':>10} {'max_rel':>10} {'rtol':>8} {'atol':>8}  ok"
        ]
        for s in self.sizes:
            rows.append(
                f"{s.size:>6}  {s.dtype:<9} {s.max_abs:>10.3e} {s.max_rel:>10.3e} "
                f"{s.rtol:>8.1e} {s.atol:>8.1e}  {'yes' if s.ok else 'NO'}"
                + (f"  ({s.note})" if s.note else "")
            )
        return "\n".join([head, *rows])

    def to_dict(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "ok": self.ok,
            "failed": self.failed,
            "sizes": [asdict(s) for s in self.sizes],
        }

    def __str__(self) -> str:
        return self.table()


def _default_inputs(runner: GraphRunner, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    out = []
    for spec in runner.specs:
        shape = spec.shape_at(n)
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            out.append(torch.randn(shape, dtype=spec.dtype, device=spec.device, generator=gen))
        else:
            out.append(torch.full(shape, spec.fill, dtype=spec.dtype, device=spec.device))
    return tuple(out)


def _compare(a: Any, b: Any) -> tuple[float, float, str]:
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


def verify(
    runner: GraphRunner,
    *,
    make_inputs: Callable[[int], Sequence[torch.Tensor]] | None = None,
    sizes: Sequence[int] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    raise_on_fail: bool = True,
    seed: int = 0,
) -> VerifyReport:
    """Replay every captured size on fresh inputs and compare with eager.

    Why: a graph can be wrong without any memory error -- the callable branches on
    Python state (a counter, a flag, a cache filled on first call) that the graph froze
    at capture, or reads a tensor replaced since. Eager execution of the same inputs is
    the reference.

    Args:
        runner: a captured runner (sanitized or not).
        make_inputs: ``make_inputs(n) -> tuple`` of inputs at batch ``n``; default:
            ``randn`` for float inputs, each input's fill value for integer and bool
            inputs (harmless rows: the padding values).
        sizes: the sizes to check (default: every captured size).
        rtol, atol: override the per-dtype tolerance (:func:`default_tolerance`).
        raise_on_fail: raise :class:`DivergenceError` naming the failing sizes.
        seed: seeds the default input generator.

    Returns a :class:`VerifyReport`. Side effects: the runner's previous outputs are
    overwritten (and poisoned on a sanitized runner), and both paths run the callable,
    so stateful callables (a KV cache) see two steps per size; the default inputs only
    touch padding rows.
    """
    name = f"GraphRunner({runner.name})"
    report = VerifyReport(runner=name)
    captured = runner.captured_sizes
    todo = sorted(set(sizes)) if sizes is not None else list(captured)
    missing = [s for s in todo if s not in captured]
    if missing:
        raise ConfigError(
            f"{name}: verify(sizes=...) asks for {missing}, which have no graph; captured "
            f"{list(captured)}"
        )
    if not todo:
        logger.info("%s: verify found no captured size to check", name)
    gen = torch.Generator(device=runner.specs[0].device)
    gen.manual_seed(seed)
    for size in todo:
        inputs = (
            tuple(make_inputs(size))
            if make_inputs is not None
            else _default_inputs(runner, size, gen)
        )
        eager_inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        with torch.no_grad():
            replay_out = pytree.tree_map_only(
                torch.Tensor, lambda t: t.clone().as_subclass(torch.Tensor), runner(*inputs)
            )
            eager_out = runner.eager(*eager_inputs)
        a_leaves, _ = flatten(replay_out)
        b_leaves, _ = flatten(eager_out)
        check = SizeCheck(
            size=size, dtype="-", max_abs=0.0, max_rel=0.0, rtol=0.0, atol=0.0, ok=True
        )
        if len(a_leaves) != len(b_leaves):
            check.ok, check.note = False, f"{len(a_leaves)} outputs vs eager {len(b_leaves)}"
            check.max_abs = check.max_rel = math.inf
        for i, (a, b) in enumerate(zip(a_leaves, b_leaves)):
            max_abs, max_rel, note = _compare(a, b)
            if isinstance(a, torch.Tensor):
                r0, a0 = default_tolerance(a.dtype)
                r, t = (rtol if rtol is not None else r0), (atol if atol is not None else a0)
                leaf_ok = not note and _within(a, b, r, t)
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
        report.sizes.append(check)
    logger.info("%s", report.table())
    if raise_on_fail and not report.ok:
        err = DivergenceError(
            f"{name}: graph replay diverges from eager at size(s) {report.failed}:\n"
            f"{report.table()}\n"
            "The graph replays what was captured; eager runs the callable again. Likely "
            "causes: the callable branches on Python state that changed since capture "
            "(a counter, a flag, a cache built on the first call), reads a tensor that "
            "was replaced after capture (run with sanitize=True), or uses randomness. If "
            "the difference is legitimate kernel noise, pass rtol=/atol=."
        )
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


def _within(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return bool(torch.equal(a, b))
    af = a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
    bf = b.to(af.dtype)
    return bool(torch.isclose(af, bf, rtol=rtol, atol=atol, equal_nan=True).all())


__all__ = [
    "GuardedOutput",
    "SanitizingGraphRunner",
    "SizeCheck",
    "TrackedStorage",
    "VerifyReport",
    "capabilities",
    "default_tolerance",
    "verify",
]
