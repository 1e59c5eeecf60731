"""State a captured step updates in place, which capture and ``verify()`` must give back.

Warmup and capture forwards really run the callable. A decode step over a static KV cache
writes cache rows and advances device-side position counters (a 0-d tensor), so after
capture the cache is not what the caller left, and a ``verify()`` that replays, then runs
eager, compares two different starting states. :class:`StateSet` names those tensors:
:meth:`StateSet.snapshot` clones them (on their device), :meth:`StateSet.restore` copies
the clones back *in place*, so every address a graph holds stays valid.

Contract: the capture lifecycle snapshots the declared state before the ``before_capture``
hooks and restores it after the last capture, also when capture fails. With no state
declared, the first warmup is watched (:func:`watch_writes`) and one warning names every
tensor outside the static inputs it wrote, with the fix (``state=[...]``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard.compiled import CompiledStep
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.walk import MAX_DEPTH, reachable_tensors, walk

logger = logging.getLogger("graphguard")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


_ATOMS = (str, bytes, int, float, complex, bool, torch.dtype, torch.device, type(None))
"""Values that can never hold a tensor: as a state entry they declare nothing."""


def _check_entries(x: Any, name: str, depth: int) -> bool:
    """Refuse entries of a ``state=`` list or dict that declare nothing (a tensor's *name*,
    a Python number, None, an iterator); True when ``x`` holds only tensors.

    Why: ``state=["cache"]`` used to declare nothing *and* switch the undeclared-write
    warning off, so capture changed the cache silently.
    """
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, _ATOMS):
        if isinstance(x, (str, bytes)):
            why = (
                "a name declares nothing: pass the tensor itself (state=[model.cache]), a "
                "dict of tensors (state={'cache': model.cache}) or the module holding them"
            )
        elif x is None:
            why = "pass the tensor, or leave the entry out"
        else:
            why = (
                "a Python value cannot be restored in place, and a graph never sees it "
                "change: keep the value the step advances in a 0-d device tensor (e.g. "
                "torch.zeros((), dtype=torch.long, device=...)) and pass that"
            )
        raise ConfigError(f"{name} is {type(x).__name__} {x!r:.60}, not a tensor; {why}")
    if depth > MAX_DEPTH:
        return False
    if isinstance(x, Mapping):
        ok = True
        for k, v in x.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ConfigError(
                    f"{name} has key {k!r} ({type(k).__name__}); state dict keys name the "
                    "tensors in messages: use strings, e.g. state={'cache': cache}"
                )
            ok = _check_entries(v, f"{name}[{k!r}]", depth + 1) and ok
        return ok
    if isinstance(x, (list, tuple)):
        ok = True
        for i, v in enumerate(x):
            ok = _check_entries(v, f"{name}[{i}]", depth + 1) and ok
        return ok
    if not hasattr(x, "__dict__"):  # a generator, a set, a slotted object: never walked
        raise ConfigError(
            f"{name} is {type(x).__name__} {x!r:.60}, which holds no tensors graphguard can "
            "find (it walks lists, tuples, dicts, modules and object attributes); pass a "
            "list of the tensors, e.g. state=[cache.k, cache.v]"
        )
    return False


class StateSnapshot:
    """Device clones of a :class:`StateSet` (opaque; pass it to :meth:`StateSet.restore`)."""

    __slots__ = ("clones", "names", "tensors")

    def __init__(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.names = names
        self.tensors = tensors
        with torch.no_grad():
            self.clones = [t.detach().clone() for t in tensors]


class StateSet:
    """Named tensors a step updates in place (KV caches, position counters, RNG offsets).

    Args:
        source: a dict ``name -> tensor``, a list/tuple of tensors, an ``nn.Module``
            (its buffers) or any object (the tensors reachable from its attributes, e.g.
            a transformers ``StaticCache``). Modules and objects are walked again at each
            :meth:`snapshot`, so tensors they rebind later are still covered.
    """

    def __init__(self, source: Any) -> None:
        if isinstance(source, _ATOMS) or not (
            isinstance(source, (Mapping, list, tuple, torch.Tensor)) or hasattr(source, "__dict__")
        ):
            raise ConfigError(
                f"state: expected a dict of tensors, a list of tensors, an nn.Module or an "
                f"object holding tensors, got {type(source).__name__} {source!r:.80}; e.g. "
                "state={'cache': cache, 'pos': pos}"
            )
        self._source = source
        # Only containers of tensors are fixed; modules and objects are walked again at
        # each snapshot (they may rebind or lazily create their tensors).
        self._static = _check_entries(source, "state", 0)
        self._entries = self._collect()

    @classmethod
    def of(cls, source: Any) -> StateSet | None:
        """``StateSet(source)``, or None for ``None``; an existing StateSet is returned as is."""
        if source is None:
            return None
        if isinstance(source, StateSet):
            return source
        return cls(source)

    def _collect(self) -> list[tuple[str, torch.Tensor]]:
        src = self._source
        found: list[tuple[str, torch.Tensor]] = []
        if isinstance(src, torch.Tensor):
            found.append(("state", src))
        elif isinstance(src, (list, tuple)):
            walk(list(src), "state", params=False, out=found)
        else:
            walk(src, "", params=False, out=found)
        unique: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in found:
            unique.setdefault(id(t), (name, t))
        meta = [f"{n} ({_describe(t)})" for n, t in unique.values() if t.is_meta]
        if meta:
            raise ConfigError(
                f"state: {_shown(meta)} {'is' if len(meta) == 1 else 'are'} on the meta "
                "device, which has no memory to snapshot or restore (a model built under "
                "torch.device('meta') and not yet materialized). Pass the materialized "
                "tensors (e.g. after module.to_empty(device=...) and loading the weights)."
            )
        return list(unique.values())

    @property
    def names(self) -> list[str]:
        """The name of every tensor in the set."""
        return [n for n, _ in self._entries]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors in the set."""
        return [t for _, t in self._entries]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> StateSnapshot:
        """Clone every tensor on its device (queued on the current stream; no host sync)."""
        if not self._static:
            self._entries = self._collect()
            if not self._entries:
                logger.warning(
                    "state=%s holds no tensors now (buffers only; parameters are not state), "
                    "so nothing is snapshotted and nothing the step writes into it will be "
                    "restored. If it creates its tensors lazily on first use, initialize it "
                    "(run one eager step) before capture, or pass the tensors themselves.",
                    type(self._source).__name__,
                )
        return StateSnapshot(self.names, self.tensors)

    def restore(self, snap: StateSnapshot) -> None:
        """Copy ``snap`` back into the same tensors in place (addresses do not change)."""
        if not isinstance(snap, StateSnapshot):
            raise ConfigError(
                f"StateSet.restore: expected what snapshot() returned, got {type(snap).__name__}"
            )
        bad = [
            f"{n}: {_describe(c)} at the snapshot, now {_describe(t)}"
            for n, t, c in zip(snap.names, snap.tensors, snap.clones)
            if t.shape != c.shape or t.dtype != c.dtype
        ]
        pairs = [
            (t, c)
            for t, c in zip(snap.tensors, snap.clones)
            if t.shape == c.shape and t.dtype == c.dtype
        ]
        inference = any(t.is_inference() for t, _ in pairs)
        with torch.inference_mode() if inference else torch.no_grad():
            for t, c in pairs:
                t.copy_(c)
        if bad:
            raise GraphGuardError(
                "state changed shape or dtype, so it cannot be restored in place: "
                + "; ".join(bad)
                + ". Update state tensors in place (copy_, index_copy_) at a fixed shape."
            )

    def __repr__(self) -> str:
        return f"StateSet({', '.join(self.names) or 'empty'})"


# ------------------------------------------------------------------ detection


def _storage_key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class _WriteWatch(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """Records storages written by ops whose schema marks an argument as written,
    excluding the static inputs and storages the forward itself allocated."""

    def __init__(self, exclude: Sequence[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.exclude = {_storage_key(t) for t in exclude} - {0}
        self.fresh: set[int] = set()
        self.written: dict[int, tuple[StorageWeakRef, str]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", "") in _COMM_NAMESPACES:
            return out  # collectives write communication buffers, not state
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            val = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in val if isinstance(val, (list, tuple)) else (val,):
                if isinstance(t, torch.Tensor) and t.numel() > 0:
                    key = _storage_key(t)
                    fresh = key in self.fresh or key in self.exclude
                    if key and not fresh and key not in self.written:
                        self.written[key] = (
                            StorageWeakRef(t.untyped_storage()),  # type: ignore[no-untyped-call]
                            _describe(t),
                        )
        rets = schema.returns
        leaves = out if isinstance(out, (list, tuple)) else (out,)
        if len(rets) == len(leaves):
            for r, t in zip(rets, leaves):
                if r.alias_info is None:
                    for x in t if isinstance(t, (list, tuple)) else (t,):
                        if isinstance(x, torch.Tensor):
                            self.fresh.add(_storage_key(x))
        return out


def _compiled(fn: Any) -> bool:
    """Whether ``fn`` runs through dynamo (``torch.compile``, graphguard's ``CompiledStep``)."""
    owner = getattr(fn, "__self__", fn)
    return any(
        isinstance(x, CompiledStep)
        or hasattr(x, "_torchdynamo_orig_callable")
        or type(x).__name__ == "OptimizedModule"
        for x in (fn, owner)
    )


@contextlib.contextmanager
def watch_writes(
    owner: str, fn: Any, static_inputs: Sequence[torch.Tensor]
) -> Iterator[list[str] | None]:
    """Watch the block for writes to tensors outside ``static_inputs``; warn once, by name.

    Used around the first warmup only (a dispatch mode is slow). A compiled callable
    is not watched (a dispatch mode would change how it runs). Yields ``None`` when it
    does not watch, else a list filled, after the block, with the tensors written.
    """
    if _compiled(fn):
        yield None
        return
    found: list[str] = []
    watch = _WriteWatch(static_inputs)
    with watch:
        yield found
    # Storages freed by the end of the forward were its temporaries (buffers a library
    # allocated outside the dispatcher), not state.
    alive = {k: desc for k, (ref, desc) in watch.written.items() if not ref.expired()}  # type: ignore[no-untyped-call]
    if alive:
        found.extend(warn_state(owner, fn, alive))


def warn_state(owner: str, fn: Any, written: Mapping[int, str]) -> list[str]:
    """Log one warning naming the tensors a warmup wrote outside the static inputs.

    ``written`` maps a storage's address to a description of the tensor written.
    """
    by_storage: dict[int, str] = {}
    try:
        for name, t in reachable_tensors(fn):
            by_storage.setdefault(_storage_key(t), name)
    except Exception as err:  # naming is best effort; the warning still goes out
        logger.debug("%s: could not walk the callable for names (%s)", owner, err)
    labels: list[str] = []
    named: list[str] = []
    for key, desc in written.items():
        label = by_storage.get(key)
        if label:
            named.append(label)
            labels.append(f"{label} ({desc})")
        else:
            labels.append(f"an unnamed {desc} tensor")
    logger.warning(
        "%s: the warmup forward wrote tensors outside the static inputs: %s. Capture's "
        "warmups change them, and verify() would compare graph and eager from different "
        "starting states. Declare them with state=[...] (e.g. state=[%s]) so capture and "
        "verify() leave them exactly as they found them, or state=[] to declare that the "
        "writes are harmless (e.g. padded rows writing a scratch slot).",
        owner,
        _shown(labels),
        _shown(named) or "the tensors",
    )
    return labels


def _shown(items: Sequence[str], limit: int = 4) -> str:
    """The first ``limit`` items and a count of the rest: one readable log line."""
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


__all__ = ["StateSet", "StateSnapshot", "warn_state", "watch_writes"]
