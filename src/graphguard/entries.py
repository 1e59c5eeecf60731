"""What the replay path reads for one batch size, precomputed at capture: an :class:`Entry`.

``Ladder.__call__`` indexes a list of entries by the batch's row count, compares
signatures, does one fused copy and replays; everything it touches is built here once,
from the static buffers, so no call allocates or decides anything a capture fixed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphguard.buffers import StaticInputs
from graphguard.sizes import PaddingTable

signature = operator.attrgetter("shape", "dtype", "device")
"""What an input must match to replay: its shape, dtype and device (one tuple compare)."""
copy_into = torch._foreach_copy_
"""``copy_into(dsts, srcs)``: one fused copy of a list of tensors into another list (one
launch however many inputs); the copy of every replay path (``Ladder.__call__``, a
subclass's ``_run`` refilling padded rows, a piece's input buffers)."""


class Entry:
    """Everything the hot path needs for one batch size ``n``; part of the ladder's subclass
    API (``_entry_parts`` supplies ``replay`` and the outputs, ``_run`` receives it).

    ``replay`` replays the size-``size`` graph(s); ``leaves``/``output`` are the cached
    output views (FULL) and ``batch_dims`` each output leaf's batch dim (None: returned
    whole; :mod:`graphguard.outputs`). ``writeback`` indexes the inputs the callable
    writes in place, whose first ``n`` rows (``writeback_srcs``) are copied back into the
    caller's tensors after the replay, as eager would have left them.
    """

    __slots__ = (
        "batch_dims",
        "countdown",
        "counted",
        "dsts",
        "leaves",
        "n",
        "output",
        "replay",
        "sig",
        "size",
        "tail_dsts",
        "tail_srcs",
        "writeback",
        "writeback_srcs",
    )
    batch_dims: list[int | None]
    countdown: int
    """Calls left until the canary checks this batch size (:mod:`graphguard.canary`);
    without a canary it starts at 0 and only goes down, never reaching 0 again. The one
    counter of the hot path doubles as the replay count (:attr:`replays`)."""
    counted: int
    """What :meth:`rearm` added to the countdown, so ``counted - countdown`` is the calls."""
    dsts: list[torch.Tensor]
    leaves: list[Any]
    n: int
    output: Any
    replay: Callable[[], Any]
    sig: list[Any]
    size: int
    tail_dsts: list[torch.Tensor]
    tail_srcs: list[torch.Tensor]
    writeback: list[int]
    writeback_srcs: list[torch.Tensor]

    def __init__(self, **kw: Any) -> None:
        self.batch_dims = []
        self.countdown = 0
        self.counted = 0
        self.leaves = []
        self.output = None
        self.writeback = []
        self.writeback_srcs = []
        for k, v in kw.items():
            setattr(self, k, v)

    def rearm(self, calls: int) -> None:
        """Set the countdown to ``calls`` without losing the call count."""
        self.counted += calls - self.countdown
        self.countdown = calls

    @property
    def replays(self) -> int:
        """Calls that found this entry since it was built (:mod:`graphguard.stats`)."""
        return self.counted - self.countdown


def build_entries(
    table: PaddingTable,
    batches: Sequence[int],
    static: StaticInputs,
    written: list[int],
    parts: Callable[[int, int], dict[str, Any]],
) -> list[Entry | None]:
    """One entry per batch size in ``batches`` (each padded by ``table``), indexed by ``n``.

    Twice as long as needed, the upper half None: a negative ``n`` (``replay(-1)``) lands
    on None and takes the slow path instead of wrapping around to the largest size.
    ``written``: the inputs the step writes in place; ``parts(n, size)``: the runner kind's
    fields (``replay``, outputs).
    """
    entries: list[Entry | None] = [None] * (2 * table.max_size + 2)
    for n in batches:
        size = table.padded(n)
        assert size is not None
        # Input views made under no_grad: copying an input that requires grad into them
        # raises before writing (instead of making the static buffers part of an autograd
        # graph). Output views are not: a replay writes their base in place.
        with torch.no_grad():
            views = static.views(n)
            tail_dsts, tail_srcs = static.tails(n)
        entries[n] = Entry(
            n=n,
            size=size,
            sig=[signature(v) for v in views],
            dsts=views,
            tail_dsts=tail_dsts,
            tail_srcs=tail_srcs,
            writeback=written,
            writeback_srcs=[views[i] for i in written],
            **parts(n, size),
        )
    return entries


__all__ = ["Entry", "build_entries", "copy_into", "signature"]
