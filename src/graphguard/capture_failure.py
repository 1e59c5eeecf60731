"""Why one size failed to capture, in its error: a host synchronize or an illegal call
inside the capture (told from other failures by the CUDA error's text or the sync
guard's error) gets the remedy, as does an RNG misuse (:func:`graphguard.rng.rng_cause`).
"""

from __future__ import annotations

from graphguard.errors import CaptureUnsafeOpError, GraphCaptureError, first_line
from graphguard.report import SizeReport
from graphguard.rng import rng_cause

# Text of the CUDA errors a host synchronization or an illegal call inside a capture
# produces (cudaErrorStreamCaptureUnsupported / Invalidated / ..., torch's sync guard).
_SYNC_MARKERS = (
    "stream is capturing",
    "streamcapture",
    "stream capture",
    "capture_invalidated",
    "capture invalidated",
    "cudaerrorstreamcapture",
    "operation not permitted when stream is capturing",
    "synchronizing cuda operation",
    "cudastreamendcapture",
    "captureunsupported",
)


def sync_related(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) looks like a host sync or illegal call in capture.

    RNG errors are not (:func:`graphguard.rng.rng_cause`), though their text names the
    stream capture status."""
    if rng_cause(exc) is not None:
        return False
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, CaptureUnsafeOpError):
            return True
        text = str(cur).lower()
        if any(m in text for m in _SYNC_MARKERS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


_SYNC_HINT = (
    " The callable must not synchronize the host (.item(), .cpu(), print of a device "
    "tensor, torch.cuda.synchronize), branch on tensor values, or allocate outside the "
    "capture stream. A lazy capture is also invalidated by another thread that "
    "synchronizes the whole device (torch.cuda.synchronize()) while it runs."
)


def size_error(name: str, size: int, exc: Exception, entry: SizeReport) -> GraphCaptureError:
    """The error of one size that failed to capture (``entry`` marked failed), with the
    remedy when the cause is known: an RNG misuse, or a host sync inside the capture."""
    entry.ok = False
    entry.error = first_line(exc)
    hint = rng_cause(exc) or (_SYNC_HINT if sync_related(exc) else "")
    err = GraphCaptureError(
        f"{name}: capturing size {size} failed: {entry.error}.{hint} Sizes that did "
        f"capture still replay; size {size} and the batches padding to it run on the next "
        "larger graph or eagerly.",
        size=size,
        cause=exc,
    )
    err.__cause__ = exc
    return err


__all__ = ["size_error", "sync_related"]
