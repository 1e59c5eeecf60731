"""What a runner hands back: output layouts established from two batch sizes.

A graph's outputs have the shapes of its captured size; a batch of ``n`` padded to that
size must get eager's shapes back. So every tensor leaf is either **batched** along one
dim (narrowed to ``n`` along it on every call) or **constant** (returned whole). Which is
which cannot be told from one size -- a constant ``[6, 6]`` table looks batched at size
6, a ``[features, batch]`` output looks constant -- so it is established from outputs at
two different batch sizes. Before the ladder, the *layout probe* runs the step uncaptured
at the largest size and at a second one (the next ladder size; ``size - 1`` for a ladder
of one size; none for a ladder of size 1 alone, where nothing is ever narrowed):

- the same shape at both: constant;
- a shape that differs in exactly one dim, equal to the batch at both: batched along it;
- anything else (several dims change, a dim that is not the batch changes, the dtype,
  the structure or a leaf's kind changes): refused, naming the leaf's path and both
  shapes, as the failure of the size being captured.

A caller that knows the layout declares it (``CaptureOptions(output_batch_dims=...)``:
``GraphedCausalLM``'s logits are ``[batch, vocab]``); nothing is then learned, a lazy
stage runs no forward for it, and the first forward's outputs are checked against the
declaration (a leaf that does not fit is refused by name, as a contradiction is).

Every later forward (each warmup and capture, any size) is checked against the layout.
When the step cannot run at a second size, the layout stays unknown: only batches equal
to a captured size replay, the others run eagerly (the runner warns once).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphguard.buffers import flatten, unflatten
from graphguard.errors import ConfigError, GraphGuardError

logger = logging.getLogger("graphguard")


def check_output_leaves(leaves: Sequence[Any], where: str) -> None:
    """Refuse Python numbers among the outputs: a graph would freeze them at capture.

    ``return logits, x.shape[0]`` gives the capture size forever, whatever the batch.
    """
    frozen = [
        f"leaf {i} = {leaf!r} ({type(leaf).__name__})"
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, numbers.Number)
    ]
    if frozen:
        raise ConfigError(
            f"{where}: the callable returns Python number(s) {', '.join(frozen)}. A graph "
            "replays its kernels, not your Python code, so such a value stays what it was "
            "at capture for every later batch. Return a tensor instead (e.g. "
            "torch.tensor(n, device=...) computed on the device), or compute the number "
            "outside the captured callable."
        )


def check_output_dims(dims: object) -> int | tuple[int | None, ...]:
    """``output_batch_dims`` (:class:`~graphguard.CaptureOptions`) normalized: an int
    >= 0, or a tuple of ints >= 0 and Nones."""

    def ok(d: object) -> bool:
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    if ok(dims):
        return dims  # type: ignore[return-value]
    if isinstance(dims, (list, tuple)) and dims and all(d is None or ok(d) for d in dims):
        return tuple(dims)
    raise ConfigError(
        f"output_batch_dims must be an int >= 0 (the batch dim of every tensor output) or "
        f"a non-empty list with one int >= 0 or None per output leaf, got "
        f"{type(dims).__name__} {dims!r:.60}; e.g. output_batch_dims=0 for logits [batch, "
        "vocab], or [0, None] for (logits, a table that does not depend on the batch)"
    )


def probe_sizes(sizes: Sequence[int]) -> list[int]:
    """The batch sizes the layout probe runs, largest first (empty: nothing to establish).

    Two sizes the step is asked to run anyway where possible: the two largest of the
    ladder. A ladder of one size ``s > 1`` adds ``s - 1`` (it fits the static buffers);
    a ladder of size 1 alone never narrows anything.
    """
    desc = sorted(sizes, reverse=True)
    if len(desc) >= 2:
        return desc[:2]
    return [desc[0], desc[0] - 1] if desc and desc[0] > 1 else []


def narrow_outputs(out: Any, dims: Sequence[int | None] | None, n: int, who: str) -> Any:
    """``out`` (outputs at a padded batch) narrowed to ``n`` rows along each leaf's batch
    dim; ``dims`` is an :class:`OutputLayout`'s (None: unknown, which is refused)."""
    leaves, spec = flatten(out)
    if dims is None:
        raise GraphGuardError(
            f"{who}: cannot narrow outputs to a batch of {n}: which outputs are batched was "
            "not established (mode 'none' captures nothing, so it never is; otherwise see "
            "the capture's warning and capture a second size the step runs at)"
        )
    cut = [x if d is None else x.narrow(d, 0, n) for x, d in zip(leaves, dims)]
    return unflatten(cut, spec)


@dataclass(frozen=True)
class _Seen:
    """One forward's outputs at one batch size, as metadata (no tensor is kept)."""

    size: int
    spec: Any
    paths: list[str]
    leaves: list[tuple[torch.dtype, tuple[int, ...]] | str]
    """Per leaf: (dtype, shape) for a tensor, else the leaf's type name."""


def _seen(size: int, out: Any) -> _Seen:
    leaves, spec = flatten(out)  # registers output dataclasses, so paths below work
    try:
        paths = [f"output{pytree.keystr(p)}" for p, _ in pytree.tree_flatten_with_path(out)[0]]
    except Exception:  # a container type registered without key paths
        paths = [f"output leaf {i}" for i in range(len(leaves))]
    if len(paths) != len(leaves):  # pragma: no cover - defensive
        paths = [f"output leaf {i}" for i in range(len(leaves))]
    metas: list[tuple[torch.dtype, tuple[int, ...]] | str] = [
        (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        for x in leaves
    ]
    return _Seen(size, spec, paths, metas)


_FIX = (
    "graphguard returns each output either whole (the same shape at every batch size) or "
    "narrowed to the batch along the one dim whose size is the batch. Return outputs of "
    "that form (e.g. view a [batch * k, ...] output as [batch, k, ...]), or run this step "
    "eagerly"
)


class OutputLayout:
    """Which dim of each output leaf is the batch (None: constant), from the forwards seen.

    ``observe(size, out)`` is called with the outputs of every forward the capture runs
    (the probe, each warmup, each capture); it raises :class:`GraphGuardError` when the
    outputs do not fit the layout. :attr:`dims` is the layout once two sizes were seen.
    """

    def __init__(self, owner: str, declared: int | Sequence[int | None] | None = None) -> None:
        self.owner = owner
        self.declared = declared
        """The caller's ``output_batch_dims`` (None: learned from two sizes)."""
        self.reset()

    def reset(self) -> None:
        """Forget every observation (a new capture establishes the layout again)."""
        self._first: _Seen | None = None
        self.dims: list[int | None] | None = None
        """Per output leaf: its batch dim, or None when it does not depend on the batch;
        None until outputs at two different sizes were seen (declared: from the start,
        an int's per-leaf list from the first forward)."""
        self.sizes_seen: list[int] = []
        self.probe_error: str | None = None
        """Why the probe could not run the step at a second size (for the warning)."""
        self.refused: str | None = None
        """Why the outputs have no layout graphguard can serve: every later forward
        fails with it, so no size is captured with a guessed layout."""
        if isinstance(self.declared, int):
            self.dims = []  # one per tensor leaf, filled at the first forward
        elif self.declared is not None:
            self.dims = list(self.declared)

    def probe(self, sizes: Sequence[int], forward: Callable[[int], Any]) -> None:
        """Start over, then run ``forward(size)`` (which calls :meth:`observe`) at the
        :func:`probe_sizes` of the ladder. A forward that raises an ``Exception`` is noted,
        not raised: that size's own warmup reports it, with the lifecycle's per-size
        failure semantics, and the ladder's other forwards may still settle the layout."""
        self.reset()
        self.run(probe_sizes(sizes), forward)

    def run(self, sizes: Sequence[int], forward: Callable[[int], Any]) -> None:
        """``forward(size)`` at each of ``sizes`` in turn, an ``Exception`` noted as
        :attr:`probe_error` (the rest then skipped), as :meth:`probe` runs them."""
        for size in sizes:
            try:
                forward(size)
            except Exception as exc:
                if self.refused is not None:
                    return  # every size's forward raises it (with per-size semantics)
                lines = str(exc).strip().splitlines()
                first = lines[0] if lines else ""
                self.probe_error = f"at batch {size}: {type(exc).__name__}: {first}"
                return

    def entry_sizes(self, who: str, captured: Sequence[int]) -> list[int]:
        """The batch sizes that replay a graph: every ``n`` up to the largest captured
        size; while the layout is unknown, the captured sizes alone (nothing to narrow;
        the others run eagerly, warned here, once per capture)."""
        top = max(captured, default=0)
        if self.dims is not None:
            return list(range(1, top + 1))
        if len(captured) < top:
            logger.warning(
                "%s: which outputs are batched could not be established: the step ran at "
                "batch %s only (the layout probe failed %s). Only batches equal to a "
                "captured size %s replay; the others run eagerly. Capture a second size the "
                "step runs at to serve padded batches.",
                who,
                self.sizes_seen,
                self.probe_error or "to run a second size",
                list(captured),
            )
        return sorted(captured)

    def observe(self, size: int, out: Any) -> None:
        """Record one forward's outputs at ``size``; raise when they contradict the layout."""
        if self.refused is not None:
            raise GraphGuardError(self.refused)
        seen = _seen(size, out)
        if size not in self.sizes_seen:
            self.sizes_seen.append(size)
        first = self._first
        if first is None:
            if self.declared is not None:
                self._check_declared(seen)
            self._first = seen
            return
        if seen.spec != first.spec:
            raise GraphGuardError(
                f"{self.owner}: at batch {size} the output structure is {seen.spec}, but at "
                f"batch {first.size} it was {first.spec}; return the same structure at every "
                "batch size"
            )
        if self.dims is None and size != first.size:
            try:
                self.dims = [self._batch_dim(first, seen, i) for i in range(len(seen.leaves))]
            except GraphGuardError as exc:
                self.refused = str(exc)
                raise
        for i, (mine, ref) in enumerate(zip(seen.leaves, first.leaves)):
            want = self._expected(ref, i, size)
            if mine != want:
                raise GraphGuardError(
                    f"{self.owner}: {seen.paths[i]} is {_show(mine)} at batch {size}, but "
                    f"{_show(want)} was expected from its layout (at batch {first.size} it was "
                    f"{_show(ref)}). {_FIX}"
                )

    def _check_declared(self, seen: _Seen) -> None:
        """The first forward's outputs against ``output_batch_dims``: a refusal (kept,
        as a contradicted learned layout is) naming the leaf that does not fit."""
        declared = self.declared
        leaves = seen.leaves
        if isinstance(declared, int):
            self.dims = [None if isinstance(x, str) else declared for x in leaves]
        elif declared is not None and len(declared) != len(leaves):
            self.refused = (
                f"{self.owner}: output_batch_dims gives {len(declared)} entries, but the step "
                f"returns {len(leaves)} output leaves ({', '.join(seen.paths)}); give one "
                "int or None per leaf, or one int for every tensor leaf"
            )
            raise GraphGuardError(self.refused)
        assert self.dims is not None
        for i, (x, d) in enumerate(zip(leaves, self.dims)):
            if d is None:
                continue
            why = None
            if isinstance(x, str):
                why = f"is {_show(x)}, not a tensor"
            elif d >= len(x[1]) or x[1][d] != seen.size:
                why = f"is {_show(x)}: its dim {d} is not the batch ({seen.size})"
            if why is not None:
                self.refused = (
                    f"{self.owner}: {seen.paths[i]} {why}, but output_batch_dims declares it "
                    f"batched along dim {d}. {_FIX}, or declare None for a leaf that does "
                    "not depend on the batch"
                )
                raise GraphGuardError(self.refused)

    def _expected(self, ref: Any, i: int, size: int) -> Any:
        """Leaf ``i``'s metadata at ``size`` by the layout (before the layout is known,
        every observation is at the first size: its metadata exactly)."""
        d = None if self.dims is None else self.dims[i]
        if isinstance(ref, str) or d is None:
            return ref
        dtype, shape = ref
        return (dtype, (*shape[:d], size, *shape[d + 1 :]))

    def _batch_dim(self, a: _Seen, b: _Seen, i: int) -> int | None:
        """Leaf ``i``'s batch dim from its shapes at two sizes, or a refusal naming both."""
        x, y = a.leaves[i], b.leaves[i]
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                raise GraphGuardError(
                    f"{self.owner}: {b.paths[i]} is {_show(y)} at batch {b.size} but "
                    f"{_show(x)} at batch {a.size}; return the same kind of value at every "
                    "batch size"
                )
            return None
        (dx, sx), (dy, sy) = x, y

        def refuse(why: str) -> GraphGuardError:
            return GraphGuardError(
                f"{self.owner}: {b.paths[i]} is {_show(y)} at batch {b.size} and {_show(x)} "
                f"at batch {a.size}: {why}, so which rows belong to a smaller batch is "
                f"ambiguous. {_FIX}"
            )

        if dx != dy:
            raise refuse("its dtype changes with the batch size")
        if len(sx) != len(sy):
            raise refuse("its number of dims changes with the batch size")
        changed = [k for k in range(len(sx)) if sx[k] != sy[k]]
        if not changed:
            return None
        if len(changed) > 1:
            raise refuse(f"dims {changed} all change with the batch size")
        k = changed[0]
        if sx[k] != a.size or sy[k] != b.size:
            raise refuse(f"dim {k} changes with the batch size but is not the batch")
        return k


def _show(meta: Any) -> str:
    if isinstance(meta, tuple):
        return f"{str(meta[0]).removeprefix('torch.')} {list(meta[1])}"
    return f"a {meta}"


__all__ = [
    "OutputLayout",
    "check_output_dims",
    "check_output_leaves",
    "narrow_outputs",
    "probe_sizes",
]
