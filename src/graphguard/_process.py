"""Process-wide state graphguard keeps, and the one place that forgets it (for tests).

Every registry that outlives a runner is listed here, so a test suite (or an engine
that tears one model down and builds another) can start from a clean process with one
call, and a new registry has one obvious place to be added:

- ``streams._registry``: the streams checked for queued work before every capture
  (:func:`~graphguard.watch_stream`, every :class:`~graphguard.AuxStream`, each
  ``CudaBackend``'s capture stream);
- ``backend._CAPTURE_STREAMS``: the one capture stream per device that backends share;
- ``_unwind._POOL_STAND_INS``: fresh pools standing in for pools a failed capture left
  unusable;
- ``sanitizer.checks._logged_caps``: whether the sanitizer's capability line was logged
  (only when the sanitizer was imported: resetting does not import it);
- this context's capture phase (:func:`graphguard.phase.reset`).

Kept on purpose:

- ``_unwind._ABANDONED_GRAPHS``, the graphs of failed captures: freeing one can drop
  its pool's last reference (the next capture into that pool then fails an internal
  assert) and frees what the host allocator's leftover routing still points at (see
  ``_unwind.abort_capture``). Their number is ``CaptureReport.abandoned_graphs``.
- ``integrations._hf_blocks._ONE_LAYER_CLASSES``, one generated class per cache class:
  idempotent, bounded by the cache classes used, and clearing it would make a live
  ``GraphedCausalLM(compile=True)`` generate a second class, which its compiled block
  would guard on and recompile for.
- the sanitizer's ``synchronize`` patch state (``sanitizer.unsafe``): reference-counted
  while a sanitized warmup runs, and empty otherwise.

Guard-failure counters are per compiling object (``_torch_compat.GuardFailures``), so
there is none to reset.
"""

from __future__ import annotations

import sys

from graphguard import _unwind, backend, phase, streams


def reset_process_state() -> None:
    """Forget every process-wide registry listed in the module docstring.

    For tests and teardown: objects built before the call (runners, backends,
    ``AuxStream``\\ s, watched streams) are not re-registered, so build them after it;
    a runner captured before it keeps working but its streams are no longer checked,
    and an old pool a failed capture left unusable is no longer swapped for its
    stand-in. Not thread-safe against a capture running on another thread.
    """
    streams.forget_registered()
    backend.forget_capture_streams()
    _unwind.forget_pool_stand_ins()
    sanitizer_runner = sys.modules.get("graphguard.sanitizer.checks")
    if sanitizer_runner is not None:
        sanitizer_runner.forget_capabilities_logged()
    phase.reset()


__all__ = ["reset_process_state"]
