"""The caller's autocast around a capture: no cached weight casts inside graphs, one policy.

Hazard: a runner captured inside the caller's ``with torch.autocast("cuda",
dtype=torch.bfloat16):`` with autocast's weight-cast cache on (the default). The first
warmup casts each fp32 weight to bf16 and caches the copy (general pool); the capture
then finds the copy in the cache, records no cast, and bakes the copy's address. Leaving
the autocast block clears the cache and frees the copies, and later replays read whatever
reuses that memory (3.6e12 off eager in issue 20). A cast made *during* a capture is no
better: its copy is cached, so the next (smaller) capture of the ladder records no cast
and reads a copy only the first graph writes. ``torch.cuda.make_graphed_callables``
refuses ``cache_enabled=True`` for this reason.

graphguard empties autocast's cache right before and right after every capture
(:func:`fresh_casts`). Each graph then records its own cast kernels, their copies are
ordinary intermediates of the graph's pool, and no cache entry outlives the capture that
made it, so replays compute what eager computes under that autocast (a cached and a fresh
cast give the same values) whatever the caller does with its autocast block afterwards.
This holds for an autocast inside the step too, whatever its ``cache_enabled``. Why not
switch the cache off for the lifecycle instead: ``torch.compile`` guards on that flag, so
a compiled step would recompile at the first call after capture. The cost: the caller's
own cached casts are dropped at each capture and re-made by its next eager call.

A graph keeps the autocast policy (enabled, dtype per device type) it was captured under,
as with ``torch.cuda.graph``: replaying it outside the autocast block still computes in
bf16. :class:`AutocastPolicy` records that policy at capture, so a runner's eager paths
(batches above the ladder, ``verify()``'s reference) run under the same policy whatever
autocast the caller is in at call time, and a runner's outputs never change dtype with
the batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_DEVICE_TYPES = ("cuda", "cpu")


def _state(device_type: str) -> tuple[bool, torch.dtype]:
    return (
        bool(torch.is_autocast_enabled(device_type)),
        torch.get_autocast_dtype(device_type),
    )


@dataclass(frozen=True)
class AutocastPolicy:
    """Whether autocast is on, and its dtype, per device type (``cuda``, ``cpu``)."""

    cuda: tuple[bool, torch.dtype]
    cpu: tuple[bool, torch.dtype]

    @classmethod
    def current(cls) -> AutocastPolicy:
        """This thread's autocast state now."""
        return cls(cuda=_state("cuda"), cpu=_state("cpu"))

    @property
    def enabled(self) -> bool:
        """Whether autocast is on for any device type."""
        return self.cuda[0] or self.cpu[0]

    def describe(self) -> str:
        """``"cuda bfloat16"``, ``"cuda float16, cpu bfloat16"`` or ``"off"``."""
        on = [
            f"{name} {str(dtype).removeprefix('torch.')}"
            for name, (enabled, dtype) in (("cuda", self.cuda), ("cpu", self.cpu))
            if enabled
        ]
        return ", ".join(on) or "off"

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """This policy for the block; nothing is entered for a device type whose current
        state already matches it (the usual case costs four flag reads)."""
        with contextlib.ExitStack() as stack:
            for name in _DEVICE_TYPES:
                want = getattr(self, name)
                if _state(name) == want:
                    continue
                enabled, dtype = want
                if enabled:
                    stack.enter_context(torch.autocast(name, dtype=dtype))
                else:
                    stack.enter_context(torch.autocast(name, enabled=False))
            yield


def applied(policy: AutocastPolicy | None) -> contextlib.AbstractContextManager[None]:
    """``policy.applied()``, or nothing for None (no graphs captured: the caller's own)."""
    return policy.applied() if policy is not None else contextlib.nullcontext()


@contextlib.contextmanager
def fresh_casts() -> Iterator[None]:
    """Autocast's weight-cast cache emptied on entry and on exit (also on failure).

    Around one capture: the graph records every cast it needs, and no cached copy made
    inside it (a block of the graph's pool) is found by a later capture or eager call.
    ``torch.clear_autocast_cache`` only drops this thread's cache entries (no sync)."""
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


__all__ = ["AutocastPolicy", "applied", "fresh_casts"]
