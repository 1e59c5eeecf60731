"""A size's first call, run eagerly as its warmup (:meth:`LazyCapture.first_call
<graphguard.lazy.LazyCapture.first_call>`): the forward under the warmup rules
(:func:`warm_forward`) and the generator check around it (:class:`Draws`).

The caller's inputs are copied into the static buffers, the padded rows refilled, and the
step runs uncaptured at the padded size under the lifecycle's warmup rules (phase WARMUP,
so auxiliary-stream overlap is off; the graphs' grad mode and autocast policy; the
sanitizer's warmup checks; the arenas locked as every lazy warmup sees them; the
generators checked for a reseed; with no ``state=`` declared, watched for undeclared
writes), then a device synchronize. Its result, narrowed to the batch, is returned, and
the rows it wrote back into the caller's inputs, as a replay would: it is the forward the
request needs anyway. Declared state is written once, by the request (nothing is
snapshotted or restored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard import phase
from graphguard.autocast import AutocastPolicy, applied
from graphguard.buffers import flatten
from graphguard.outputs import check_output_leaves
from graphguard.state import watch_writes


def warm_forward(
    label: str,
    forward: Callable[[], Any],
    *,
    modes: tuple[bool, bool, AutocastPolicy | None],
    watch: Any,
    scratch: Sequence[torch.Tensor],
) -> tuple[Any, list[str] | None]:
    """A first call's forward (``forward``: the ladder's observed forward on the static
    buffers) under the warmup rules: phase WARMUP (auxiliary overlap off; the sanitizer's
    warmup checks hook the forward), the graphs' ``modes`` (inference mode, grad mode,
    autocast policy), and, when ``watch`` is the step (no ``state=`` declared), the watch
    for writes outside ``scratch`` (the static inputs and arenas) that a capture run's
    first warmup keeps. Returns the outputs and the writes seen (None: not watched)."""
    inference, grad, autocast = modes
    with (
        torch.inference_mode(inference),
        torch.set_grad_enabled(grad),
        applied(autocast),
        phase.enter(phase.Phase.WARMUP, owner=label, first_call=True),
        watch_writes(label, watch, scratch)
        if watch is not None
        else contextlib.nullcontext(None) as seen,
    ):
        out = forward()
    check_output_leaves(flatten(out)[0], f"{label} (first call, a warmup)")
    return out, seen


class Draws:
    """The step's CUDA generators around a first call, checked as the lifecycle checks its
    warmups (:class:`graphguard.rng.ReseedCheck`): each offset is moved far ahead, so a
    step that reseeds or rewinds one shows; then moved back by as much, so the generator
    ends where the request's own draws left it."""

    _AHEAD = 1 << 40  # a multiple of 4, as philox offsets must be

    def __init__(self, named: Sequence[tuple[str, torch.Generator]]) -> None:
        self._named = [(n, g) for n, g in named if g.device.type == "cuda"]
        self._start = [(g.initial_seed(), g.get_offset()) for _, g in self._named]
        for _, g in self._named:
            g.set_offset(g.get_offset() + self._AHEAD)

    def check(self, where: str) -> str | None:
        """What a generator the step reseeded or rewound says (None: none was)."""
        for (name, g), (seed0, off0) in zip(self._named, self._start):
            seed, off = g.initial_seed(), g.get_offset()
            if seed != seed0 or off < off0 + self._AHEAD:
                return (
                    f"{where}: the step reseeded or rewound generator {name!r} (seed {seed0} "
                    f"-> {seed}, offset {off0 + self._AHEAD} -> {off}): it calls manual_seed, "
                    "seed(), set_state or torch.manual_seed while it runs, so eagerly it "
                    "draws the same numbers every call, which a graph cannot replay"
                )
        return None

    def rewind(self) -> None:
        """Each generator the step left ahead, moved back by what :meth:`__init__` added."""
        for (_, g), (seed0, off0) in zip(self._named, self._start):
            off = g.get_offset()
            if g.initial_seed() == seed0 and off >= off0 + self._AHEAD:
                g.set_offset(off - self._AHEAD)


__all__ = ["Draws", "warm_forward"]
