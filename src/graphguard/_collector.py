"""The garbage collector paused during captures (:func:`paused_gc`).

Why a module of its own: the collector is process-wide, and both the capture loop
(:mod:`graphguard.capture`) and a lazy capture while serving (:mod:`graphguard.lazy`)
pause it, by one rule.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic garbage collection inside the block; the collector's state is restored
    on every exit (an exception or interrupt included), and a block nested in another
    leaves it to the outer one.

    Where: the capture loop of every run, and the whole of a lazy capture, from the
    budget check to the settle (:meth:`graphguard.lazy.LazyCapture.capture`), so a
    collection never lands between its phases while a request waits. Every object of a
    capture is alive, so a collection in the middle only costs time: a full
    (generation-2) collection in a process that imported torch and transformers took
    176 ms on the 2-core CPU box of the tests (349k tracked objects), more than a whole
    warm capture of the reference 1B step on an H200.

    Why ``gc.disable()`` and not vLLM's ``freeze_gc`` (``gc.collect()``, ``gc.freeze()``,
    then ``gc.unfreeze()`` and ``gc.collect()`` again): that pays two full collections per
    capture, which is fine once at start-up and is the very cost to avoid while serving;
    and ``gc.unfreeze()`` cannot tell whose objects it thaws, so it would undo an engine's
    own ``gc.freeze()`` of its start-up heap (vLLM's ``freeze_gc_heap``). Disabling only
    defers: the allocation count carries over, and since an older generation's counter
    advances only with the younger collections the pause skipped, the first collection
    after it is the one that was due anyway (mostly a young one, over what the capture
    left behind), not a full one the pause made due. No full ``gc.collect()`` first either,
    for the same reason (``torch.cuda.graph`` collects only under
    ``torch.compiler.config.force_cudagraph_gc``); garbage in the general pool does not
    change what a capture records. An explicit ``gc.collect()`` inside still runs.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


__all__ = ["paused_gc"]
