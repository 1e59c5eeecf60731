"""Named scratch arenas that refuse to move once graphs point into them.

Hazard: arena growth after capture. A graph captured while using a shared scratch
buffer freezes its address; growing the arena later (allocate bigger, drop the old
buffer) leaves the graphs writing into freed memory. :class:`Workspace` grows while
*open* (profiling, warmups), and once :meth:`Workspace.lock`-ed (the runner locks it
after capture) or while a real capture records, a request that does not fit raises
:class:`~graphguard.errors.WorkspaceLockedError` naming the arena, the bytes and the
calling line. Every :meth:`Workspace.get` starts at offset 0: one arena serves one
stream per step (see the class docstring). No module-level registry: the runner gets
its arenas explicitly, so two engines in one process never lock each other's memory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import torch

from graphguard import phase
from graphguard._device import device_total_bytes, fmt_bytes, parse_device
from graphguard._sites import user_site
from graphguard.errors import ConfigError, WorkspaceLockedError
from graphguard.sizes import is_int

logger = logging.getLogger("graphguard")

# The largest itemsize of any torch dtype (complex128). The arena base is aligned to
# at least this, so a typed view of the whole arena is valid for every dtype.
_MAX_ITEMSIZE = 16

Spec: TypeAlias = tuple[Sequence[int] | torch.Size, torch.dtype]
"""One requested view: ``(shape, dtype)``."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _size_class(n: int) -> int:
    """Round ``n`` up to a value with at most three significant bits (1, 1.125 … 1.875 × 2**k).

    Why: warmups often request slowly creeping sizes (batch 1, 2, 3 …). Growing to the
    exact request would reallocate — and free a buffer — on every step; rounding to
    power-of-two-ish classes caps that at eight growths per doubling while wasting at
    most 12.5 % (a plain next-power-of-two would waste up to 50 % of a large arena).
    """
    if n <= 8:
        return n
    shift = n.bit_length() - 3
    return _round_up(n, 1 << shift)


def _call_site() -> str:
    """``file:line`` of the user's line that asked (see :mod:`graphguard._sites`)."""
    return user_site(function=False)


def _bad_spec(name: str, i: int, spec: Any) -> ConfigError:
    return ConfigError(
        f"Workspace {name!r}: get() argument {i} is {spec!r}; each argument must be a "
        "(shape, dtype) pair with a tuple of non-negative ints as shape and a "
        "torch.dtype (e.g. ((4, 128), torch.float16)), not a dtype string, None or "
        "float dimensions"
    )


def _checked(name: str, i: int, spec: Any) -> tuple[Sequence[int], torch.dtype, int]:
    """(shape, dtype, numel) of one get() argument; the slow path of :meth:`Workspace.get`."""
    try:
        shape, dtype = spec
    except (TypeError, ValueError):
        raise _bad_spec(name, i, spec) from None
    if not isinstance(dtype, torch.dtype):
        raise _bad_spec(name, i, spec)
    if isinstance(shape, int) or not isinstance(shape, (tuple, list, torch.Size)):
        raise _bad_spec(name, i, spec)
    if not all(is_int(d) for d in shape):
        raise _bad_spec(name, i, spec)
    if any(d < 0 for d in shape):
        raise ConfigError(
            f"Workspace {name!r}: get() argument {i} has shape {tuple(shape)}; dimensions "
            "must be non-negative (-1 is not inferred here)"
        )
    return shape, dtype, math.prod(shape)


class Workspace:
    """A named, growable-until-locked scratch arena on one device.

    Views returned by :meth:`get` alias the arena: they are valid until the next
    growth (which swaps the buffer) and are overwritten by the next user of the same
    region. Contents are *not* preserved across growth — it is scratch memory.

    One arena, one stream per step: every :meth:`get` starts at offset 0, so views the
    main stream and an auxiliary branch (:class:`~graphguard.AuxStream`) take from the
    same arena in one step alias each other and race once the branch overlaps. Give
    each stream its own arena; with ``sanitize=True`` a second stream's ``get`` raises
    :class:`~graphguard.errors.ArenaStreamAliasError`.

    Not meant for concurrent growth from several threads without coordination; the
    growth path itself is serialized, the fitting path takes no lock (it must stay
    cheap on the replay/serving path).

    Args:
        name: shown in every log line and error, so the user knows which arena.
        device: where the arena lives; ``None`` means ``"cuda"`` when CUDA is
            available, else ``"cpu"``.
        alignment: byte alignment of the *address* of every view (a power of two).
            256 suits vectorized and tensor-core kernels; views of dtypes wider than
            ``alignment`` are aligned to their itemsize.
        reserve_bytes: capacity to allocate up front (see :meth:`reserve`).
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str | None = None,
        *,
        alignment: int = 256,
        reserve_bytes: int = 0,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError("Workspace name must be a non-empty string")
        if not is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(
                f"Workspace {name!r}: alignment must be a positive power of two, got {alignment!r}"
            )
        dev = parse_device(f"Workspace {name!r}", device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"Workspace {name!r}: device={device!r} but CUDA is not available on this "
                "machine; pass device='cpu' (or leave device=None to pick CUDA when present)"
            )
        self.name: str = name
        self.device: torch.device = dev
        self.alignment: int = alignment
        # Base address alignment and capacity granule: at least the widest itemsize,
        # so one typed view of the whole arena per dtype is always valid.
        self._granule = max(alignment, _MAX_ITEMSIZE)
        self._buffer: torch.Tensor | None = None
        self._capacity = 0
        self._peak = 0
        self._growths = 0
        self._locked = False
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._mutex = threading.Lock()
        self._observer: Callable[[Workspace], Any] | None = None
        """Called by every get() while set (:meth:`observe`)."""
        if reserve_bytes:
            self.reserve(reserve_bytes)

    # ------------------------------------------------------------------ properties

    @property
    def nbytes(self) -> int:
        """Current usable capacity in bytes."""
        return self._capacity

    @property
    def peak_bytes(self) -> int:
        """The largest single request (sum of one :meth:`get` call's aligned views) seen.

        Includes requests refused because the arena was locked (or capturing), so after
        such an error ``reserve(peak_bytes)`` before capture is the fix; a request whose
        allocation failed (out of memory) is not counted.
        """
        return self._peak

    @property
    def locked(self) -> bool:
        """Whether growth is refused (graphs may hold pointers into the buffer)."""
        return self._locked

    @property
    def growths(self) -> int:
        """How many times the buffer was reallocated (each one freed the previous buffer)."""
        return self._growths

    @property
    def buffer(self) -> torch.Tensor | None:
        """The whole arena (``None`` before it first grows): the memory graphs capture
        addresses into. Read-only; each growth replaces it, freeing the previous one."""
        return self._buffer

    @contextlib.contextmanager
    def observe(self, fn: Callable[[Workspace], Any]) -> Iterator[bool]:
        """Call ``fn(self)`` at the start of every :meth:`get` inside the block.

        Why: a check such as the sanitizer's one-arena-one-stream rule must see who asks
        for views, while an unobserved ``get`` stays one ``is None`` test. One observer at
        a time: when one is already installed (an enclosing check), it is kept and the
        block yields ``False``; otherwise ``fn`` is installed, the block yields ``True``,
        and ``fn`` is removed on exit, also on error.
        """
        if self._observer is not None:
            yield False
            return
        self._observer = fn
        try:
            yield True
        finally:
            self._observer = None

    # ------------------------------------------------------------------ hot path

    def get(self, *specs: Spec) -> tuple[torch.Tensor, ...]:
        """Carve one view per ``(shape, dtype)`` spec from the start of the arena.

        The views are laid out one after another, each starting at an address aligned
        to ``max(alignment, itemsize)``, and never overlap each other; zero-element
        views take no space. When the arena fits the request this allocates nothing
        and logs nothing (it runs on the serving path); when it does not, the arena
        grows if open, else :class:`WorkspaceLockedError` is raised.
        """
        if self._observer is not None:
            self._observer(self)
        cursor = 0
        layout: list[tuple[int, int, Sequence[int] | torch.Size, torch.dtype]] = []
        for i, spec in enumerate(specs):
            try:
                shape, dtype = spec
                itemsize = dtype.itemsize
                numel = math.prod(shape)
                ok = type(numel) is int and numel >= 0
            except (TypeError, ValueError, AttributeError):
                ok = False
            if not ok:
                shape, dtype, numel = _checked(self.name, i, spec)
                itemsize = dtype.itemsize
            if numel == 0:
                layout.append((0, 0, shape, dtype))
                continue
            align = self.alignment if self.alignment >= itemsize else itemsize
            start = _round_up(cursor, align)
            cursor = start + numel * itemsize
            layout.append((start // itemsize, numel, shape, dtype))
        if cursor > self._capacity:
            self._grow_for(cursor, exact=False)
        if cursor > self._peak:
            self._peak = cursor
        typed = self._typed
        out: list[torch.Tensor] = []
        try:
            for offset, numel, shape, dtype in layout:
                flat = typed.get(dtype)
                if flat is None:
                    flat = self._typed_view(dtype)
                out.append(flat[offset : offset + numel].view(shape))
        except TypeError:
            for i, spec in enumerate(specs):  # e.g. a bool dimension: name the argument
                _checked(self.name, i, spec)
            raise
        return tuple(out)

    def view(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """One view at the arena start; same as ``get((shape, dtype))[0]``."""
        return self.get((shape, dtype))[0]

    # ------------------------------------------------------------------ sizing

    def reserve(self, nbytes: int) -> None:
        """Grow to at least ``nbytes`` now, exactly (rounded to the alignment granule).

        Why: the reliable way to keep an arena from ever growing after capture is to
        size it before capture, from a known peak (``peak_bytes`` of a profiling run
        or a config value). Locked, a reserve that fits is a no-op and one that does
        not raises like a request would.
        """
        if not is_int(nbytes) or nbytes < 0:
            raise ConfigError(
                f"Workspace {self.name!r}: reserve(nbytes) needs an int >= 0 (a byte count), "
                f"got {type(nbytes).__name__} {nbytes!r:.60}"
            )
        if nbytes <= self._capacity:
            return
        self._grow_for(nbytes, exact=True)

    def _grow_for(self, requested: int, *, exact: bool) -> None:
        """The slow path: refuse (locked or capturing) or reallocate a larger buffer."""
        with self._mutex:
            if requested <= self._capacity and self._buffer is not None:
                return  # another thread grew it meanwhile
            if requested > self._capacity:
                self._refuse_impossible(requested)
                if self._locked:
                    self._peak = max(self._peak, requested)
                    raise self._locked_error(requested, capturing=False)
                if phase.is_capturing() and not phase.is_profiling():
                    self._peak = max(self._peak, requested)
                    raise self._locked_error(requested, capturing=True)
            target = requested if exact else _size_class(requested)
            capacity = max(_round_up(target, self._granule), self._capacity)
            old = self._capacity
            # The old buffer is freed only once the new one exists (growth briefly
            # holds both), so a failed allocation (out of memory) leaves the arena
            # whole at its old size and peak_bytes without the failed request. That
            # free is exactly what corrupts graphs that captured the old address —
            # hence lock() and the capture check above.
            try:
                buffer = torch.empty(
                    capacity + self._granule, dtype=torch.uint8, device=self.device
                )
            except (RuntimeError, MemoryError) as exc:
                note = getattr(exc, "add_note", None)  # Python 3.11+
                if callable(note):
                    note(
                        f"graphguard: growing workspace arena {self.name!r} from {old} to "
                        f"{capacity} bytes (request {requested}) failed; the arena keeps its "
                        f"{old}-byte buffer. Reserve it before the rest of memory is taken."
                    )
                raise
            self._typed = {}
            base = -buffer.data_ptr() % self._granule
            self._buffer = buffer[base : base + capacity]
            self._capacity = capacity
            if capacity > old:
                self._growths += 1
            logger.debug(
                "workspace %r grew %d -> %d bytes on %s (request %d, growth #%d)",
                self.name,
                old,
                capacity,
                self.device,
                requested,
                self._growths,
            )

    def _refuse_impossible(self, requested: int) -> None:
        """A :class:`ConfigError` for a request larger than the whole device.

        Such a request is a wrong shape or byte count, not a shortage: the allocator's
        raw error would not say which arena or line asked. (A request that fits the
        device but not its free memory stays torch's out-of-memory error, with a note.)
        """
        total = device_total_bytes(self.device)
        need = _round_up(requested, self._granule) + self._granule
        if total is None or need <= total:
            return
        asked = fmt_bytes(requested)
        if need > 2 * requested:  # the alignment, not the request, is what does not fit
            asked += f" ({fmt_bytes(need)} with alignment={self.alignment})"
        raise ConfigError(
            f"Workspace {self.name!r}: {_call_site()} asked for {asked}, more "
            f"than the {fmt_bytes(total)} {self.device} has in all, so the arena can never "
            "hold it. Check the shapes passed to get() (a batch or context dimension in "
            "the wrong place, a token count used as a byte count) or the reserve() "
            "argument; the arena keeps its "
            f"{fmt_bytes(self._capacity)} buffer."
        )

    def _typed_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole arena viewed as ``dtype`` (cached per dtype until the next growth)."""
        if self._buffer is None:
            self._grow_for(0, exact=True)
        assert self._buffer is not None
        flat = self._buffer.view(dtype)
        self._typed[dtype] = flat
        return flat

    def _locked_error(self, requested: int, *, capturing: bool) -> WorkspaceLockedError:
        site = _call_site()
        locked = self._capacity
        if capturing:
            why = (
                f"workspace arena {self.name!r} is being recorded into a CUDA graph "
                f"(capture in progress) and {site} asked for {requested} bytes, more than "
                f"its {locked} bytes. Growing now would free the buffer that kernels "
                "already recorded into this graph (and any graph captured before) point "
                "at, so replays would write into freed memory."
            )
        else:
            why = (
                f"workspace arena {self.name!r} is locked at {locked} bytes and {site} "
                f"asked for {requested} bytes ({requested - locked} more). Growing it would "
                "free the buffer captured CUDA graphs replay into, so their next replay "
                "would write into freed memory."
            )
        fix = (
            " To fix: run this shape before capture — add a `before_capture` kernel "
            "warmup on the runner that exercises it with realistic shapes, so the arena "
            f"reaches its peak while still open — or call reserve({requested}) on "
            f"Workspace({self.name!r}) before capture. If the model deliberately changed "
            "(weights reloaded), use `with arena.unlocked(reason=...)` and recapture "
            "every graph."
        )
        return WorkspaceLockedError(
            why + fix, arena=self.name, requested=requested, locked=locked, site=site
        )

    # ------------------------------------------------------------------ locking

    def lock(self) -> None:
        """Refuse growth from now on (call once graphs point into the buffer)."""
        self._locked = True
        logger.debug("workspace %r locked at %d bytes", self.name, self._capacity)

    def poison(self) -> bool:
        """Fill the whole arena with ``0xFF`` bytes; returns whether it had a buffer to fill.

        Why: a step that reads scratch it did not write in the same call (a row past the
        ones it wrote, what the previous call left, memory never written since the
        allocation) reads whatever is there, often zeros or values derived from the
        harmless fill values, and passes by luck. ``0xFF`` bytes are NaN in every IEEE
        float view the arena hands out (float64/32/16, bfloat16, float8 e4m3fn/e5m2;
        float8's ``fnuz`` formats read their most negative finite value), so such a read
        makes NaN that the canary or ``verify()`` reports. Integer views read ``-1``
        (signed) or their maximum (unsigned): a step that indexes with unwritten integer
        scratch then faults on CUDA rather than diverges.

        The capture lifecycle calls it right after it locks an arena, with ``sanitize=True``
        or ``Canary(poison_arenas=True)`` (:mod:`graphguard.canary`): lock time only,
        never on the replay path, and never while a graph records (the fill would become
        part of the graph). The fill is queued on the current stream, after the
        capture's synchronized warmups and before any replay on that stream.
        """
        if phase.is_capturing():
            raise ConfigError(
                f"Workspace {self.name!r}: poison() called while a CUDA graph is being "
                "captured; the fill would be recorded into the graph and replayed every "
                "step. Poison after capture (the runner does it at the lock with "
                "sanitize=True or Canary(poison_arenas=True))."
            )
        if self._buffer is None:
            return False
        self._buffer.fill_(0xFF)
        logger.debug("workspace %r poisoned (%d bytes of 0xFF)", self.name, self._capacity)
        return True

    def unlock(self, *, reason: str) -> None:
        """Allow growth again, deliberately; ``reason`` is logged for the post-mortem.

        Every graph captured against this arena must be recaptured afterwards if it
        grows, which is why a reason is mandatory.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError(
                f"Workspace {self.name!r}: unlock(reason=...) needs a non-empty reason, e.g. "
                "unlock(reason='weights reloaded')"
            )
        self._locked = False
        logger.info("workspace %r unlocked at %d bytes: %s", self.name, self._capacity, reason)

    @contextlib.contextmanager
    def unlocked(self, reason: str) -> Iterator[Workspace]:
        """Unlock for the block and restore the previous lock state after, even on error.

        An arena that was locked on entry is locked again on exit, so a recapture
        (or any deliberate resize) cannot accidentally leave it open while serving.
        """
        if not isinstance(reason, str) or not reason.strip():
            self.unlock(reason=reason)  # the same error, whether or not it is locked now
        was_locked = self._locked
        if was_locked:
            self.unlock(reason=reason)
        try:
            yield self
        finally:
            if was_locked:
                self.lock()

    # ------------------------------------------------------------------ reporting

    def info(self) -> dict[str, object]:
        """A JSON-ready summary for the capture report."""
        return {
            "name": self.name,
            "device": str(self.device),
            "alignment": self.alignment,
            "nbytes": self._capacity,
            "peak_bytes": self._peak,
            "locked": self._locked,
            "growths": self._growths,
        }

    def __repr__(self) -> str:
        state = "locked" if self._locked else "open"
        return (
            f"Workspace({self.name!r}, device={str(self.device)!r}, "
            f"nbytes={self._capacity}, peak_bytes={self._peak}, {state})"
        )


__all__ = ["Spec", "Workspace"]
