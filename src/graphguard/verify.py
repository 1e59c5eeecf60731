"""Graph replay against eager execution, for any runner.

:func:`verify` replays every captured size on fresh inputs through the runner's
normal call path and compares each output leaf with the same callable run eagerly
(per-dtype tolerance, integers exactly); a divergence raises
:class:`~graphguard.errors.DivergenceError` carrying a :class:`VerifyReport`. It needs
only :class:`Verifiable` (``captured_sizes``, ``specs``, ``__call__``, ``eager``):
``GraphRunner``, ``PiecewiseRunner`` and ``DistributedGraphRunner`` all qualify.
A runner with declared state (``runner.state``: ``snapshot()``/``restore(snap)``)
has it restored before each replay and each eager run, and once more at the end, so
both start from the same state and verify leaves the state as it found it. Generators
(the runner's ``generators()``, else the device's default one) are handled like eager:
each eager reference run starts from the seed and offset its replay started from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from graphguard.arguments import check_tolerances
from graphguard.buffers import InputSpec
from graphguard.errors import ConfigError, DivergenceError, GraphGuardError
from graphguard.replay_vs_eager import (
    check_inputs,
    check_size,
    compare,
    default_tolerance,
    has_signal,
    owned,
    within,
)
from graphguard.report import SizeCheck, VerifyReport
from graphguard.rng import GeneratorStates, default_generator
from graphguard.sizes import PaddingTable, is_int

logger = logging.getLogger("graphguard")


class Verifiable(Protocol):
    """What :func:`verify` needs of a runner."""

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have a graph, ascending."""
        ...

    @property
    def specs(self) -> Sequence[InputSpec]:
        """One spec per input (dtype, device, shape at a batch size, fill value)."""
        ...

    def __call__(self, *inputs: Any) -> Any:
        """The graph path: replay the padded size's graph."""
        ...

    def eager(self, *inputs: Any) -> Any:
        """The reference path: the callable run eagerly."""
        ...


class StateLike(Protocol):
    """Declared state (``graphguard.state.StateSet``): what capture and verify must keep."""

    def snapshot(self) -> object:
        """A copy of every state tensor."""
        ...

    def restore(self, snap: object) -> None:
        """Copy ``snap`` back into the state tensors, in place."""
        ...


def _default_inputs(
    specs: Sequence[InputSpec], n: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    out = []
    for spec in specs:
        shape = spec.shape_at(n)
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            out.append(torch.randn(shape, dtype=spec.dtype, device=spec.device, generator=gen))
        else:
            out.append(torch.full(shape, spec.fill, dtype=spec.dtype, device=spec.device))
    return tuple(out)


def _generators(runner: Any, device: torch.device) -> list[torch.Generator]:
    """The generators graph and eager must start from alike (the ones the graphs
    registered, which a runner's door says; for one that does not, the device's default
    generator)."""
    find = getattr(getattr(runner, "door", None), "generators", None)
    if callable(find):
        return [g for _, g in find()]
    default = default_generator(device)
    return [default] if default is not None else []


def _check_arguments(
    runner: Any,
    name: str,
    make_inputs: Any,
    sizes: Any,
    rtol: Any,
    atol: Any,
    raise_on_fail: Any,
    seed: Any,
) -> list[int] | None:
    """:class:`ConfigError` naming the first bad argument of :func:`verify`, before any work;
    returns ``sizes`` as a list (a generator is read once, here).

    Why: ``rtol=-1`` was torch's raw error after the first replay, ``sizes=4`` a
    ``TypeError``, and ``raise_on_fail="no"`` raised (a non-empty string is true).
    """
    where = f"{name}: verify"
    if not callable(runner) or not all(
        hasattr(runner, a) for a in ("captured_sizes", "specs", "eager")
    ):
        raise ConfigError(
            f"verify(runner): expected a graphguard runner (GraphRunner, PiecewiseRunner, "
            f"DistributedGraphRunner), got {type(runner).__name__} {runner!r:.60}"
        )
    if make_inputs is not None and not callable(make_inputs):
        raise ConfigError(
            f"{where}(make_inputs=...) must be a function n -> tuple of inputs at batch n, "
            f"got {type(make_inputs).__name__} {make_inputs!r:.60}"
        )
    if sizes is not None:
        if isinstance(sizes, (int, str, bytes)) or not isinstance(sizes, Iterable):
            raise ConfigError(
                f"{where}(sizes=...) must be a list of captured sizes, got "
                f"{type(sizes).__name__} {sizes!r:.60}; e.g. sizes=[{sizes!r:.20}]"
            )
        listed: list[int] = list(sizes)
        bad = [s for s in listed if not is_int(s)]
        if bad:
            raise ConfigError(
                f"{where}(sizes=...): {bad[:5]!r} are not ints; pass sizes from "
                "runner.captured_sizes"
            )
    check_tolerances(where, rtol, atol)
    if not isinstance(raise_on_fail, bool):
        raise ConfigError(
            f"{where}(raise_on_fail=...) must be True or False, got "
            f"{type(raise_on_fail).__name__} {raise_on_fail!r:.60}"
        )
    if not is_int(seed) or not -(2**63) <= seed < 2**64:
        raise ConfigError(
            f"{where}(seed=...) must be an int (a torch.Generator seed), got "
            f"{type(seed).__name__} {seed!r:.60}"
        )
    return None if sizes is None else listed


def _nothing_to_verify(name: str, runner: Any) -> GraphGuardError:
    """Why a runner has no graph, for the error (verify never reports ok on nothing).

    Read through public attributes only (``mode``, ``report``, ``lazy``, ``serving``,
    ``stats()``): a lazy runner that is serving has captured nothing yet (its sizes are
    captured on first use) or every size it tried failed; any runner may be released."""
    report = getattr(runner, "report", None)
    mode = getattr(getattr(runner, "mode", None), "value", None)
    failed = list(getattr(report, "failed", None) or [])
    lazy = getattr(runner, "lazy", False) is True
    serving = getattr(runner, "serving", None)
    if mode == "none":
        why = "it runs mode 'none' (everything eagerly), so there is no graph to compare"
    elif lazy and serving is True:
        why = _lazy_nothing(runner)
    elif failed and serving is not False:
        why = (
            f"every size failed to capture ({failed}, on_capture_error='skip'), so every "
            "call runs eagerly; see the capture report for each size's error"
        )
    elif report is not None and serving is not True:
        why = "its graphs were released (release()); call capture() again"
    elif report is not None:
        why = "no size was captured; see runner.stats() for each size"
    else:
        why = "capture() has not run yet"
    return GraphGuardError(
        f"{name}: verify() has nothing to check: no graph is captured ({why}). A verify "
        "that replays no graph would compare eager with eager and prove nothing."
    )


def _lazy_nothing(runner: Any) -> str:
    """Why a serving lazy runner has no graph: nothing captured yet, or every size it
    tried failed (the sizes by status from ``runner.stats()``)."""
    stats = getattr(runner, "stats", None)
    sizes = list(getattr(stats(), "sizes", None) or []) if callable(stats) else []
    by: dict[str, list[int]] = {}
    for st in sizes:
        by.setdefault(str(st.status), []).append(int(st.size))
    failed = by.get("failed", [])
    pending = sorted(by.get("pending", []) + by.get("warmed", []) + by.get("evicted", []))
    over = by.get("over budget", [])
    if failed and not pending:
        why = f"every size's capture failed ({failed}): see runner.stats()"
        return why + (f"; {over} over graph_memory_budget" if over else "")
    why = (
        "lazy: no size captured yet -- a size's first call runs eagerly as its warmup and "
        "the next captures it; call the runner (or capture_for(n)) first"
    )
    if failed:
        why += f"; sizes {failed} failed to capture (see runner.stats()), {pending} not tried yet"
    if over:
        why += f"; sizes {over} are over graph_memory_budget and run eagerly"
    return why


def _replayed(
    name: str, size: int, inputs: Sequence[Any], specs: Sequence[InputSpec], table: PaddingTable
) -> int:
    """The batch of ``make_inputs(size)``'s inputs; raise unless it replays the size-``size``
    graph (another batch would check another graph, or none, and report ``size`` green)."""
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or first.ndim <= specs[0].batch_dim:
        return size  # malformed: the runner's own call raises InputMismatchError naming it
    batch = int(first.shape[specs[0].batch_dim])
    padded = table.padded(batch)
    if padded != size:
        shapes = ", ".join(
            f"{s.name} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            for s, x in zip(specs, inputs)
        )
        where = f"the size-{padded} graph" if padded else "eagerly (above every captured size)"
        raise ConfigError(
            f"{name}: verify checks size {size}, but make_inputs({size}) returned a batch of "
            f"{batch} ({shapes}), which runs {where}, not the size-{size} graph. Return "
            f"inputs whose batch ({specs[0].name} dim {specs[0].batch_dim}) pads to {size}: "
            f"at most {size} rows and more than the next smaller captured size."
        )
    return batch


def _check_once(
    runner: Verifiable,
    name: str,
    size: int,
    second: bool,
    make_inputs: Callable[[int], Sequence[torch.Tensor]] | None,
    specs: Sequence[InputSpec],
    table: PaddingTable,
    gen: torch.Generator,
    generators: Sequence[torch.Generator],
    state: StateLike | None,
    snap: object,
    rtol: float | None,
    atol: float | None,
) -> tuple[SizeCheck, Any]:
    """One input set at ``size``: replay, then eager from the same state and generators.
    The second set is a batch one shorter when that still pads to ``size`` (default
    inputs), so lengths and values both differ from the first."""
    if make_inputs is not None:
        inputs = tuple(make_inputs(size))
    else:
        batch = size - 1 if second and size > 1 and table.padded(size - 1) == size else size
        inputs = _default_inputs(specs, batch, gen)
    batch = _replayed(name, size, inputs, specs, table)
    eager_inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
    # The caller's grad mode, not no_grad: a compiled step guards on it, and eager
    # must run the code path the graphs were captured from.
    rng = GeneratorStates(generators)
    if state is not None:
        state.restore(snap)
    replay_out = owned(runner(*inputs))
    rng.restore()  # eager draws what the replay drew
    if state is not None:
        state.restore(snap)
    eager_out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, runner.eager(*eager_inputs))
    check = check_size(size, replay_out, eager_out, rtol, atol)
    check.batch, check.graph = batch, size
    check_inputs(check, specs, inputs, eager_inputs, rtol, atol)
    return check, eager_out


def verify(
    runner: Verifiable,
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
        runner: a captured runner (any :class:`Verifiable`, sanitized or not).
        make_inputs: ``make_inputs(n) -> tuple`` of inputs at batch ``n``; default:
            ``randn`` for float inputs, each input's fill value for integer and bool
            inputs (harmless rows: the padding values).
        sizes: the sizes to check (default: every captured size).
        rtol, atol: override the per-dtype tolerance (:func:`default_tolerance`).
        raise_on_fail: raise :class:`DivergenceError` naming the failing sizes.
        seed: seeds the default input generator.

    State: when ``runner.state`` is set (truthy), it is snapshotted first; each size
    restores it, replays, restores it again, then runs eager, so both paths start from
    the same state; it is restored once more at the end, also on error. Without
    declared state both paths run the callable on whatever state it has (a KV cache
    sees two steps per size). The runner's previous outputs are overwritten (and
    poisoned on a sanitized runner).

    Random numbers: each size saves the seed and offset of every generator the graphs
    registered (the device's default one, ``generators=``, those reachable from the
    callable), replays, puts them back, then runs eager, so a correct random step (dropout,
    sampling) draws the same numbers on both paths and verifies clean. Afterwards each
    generator is exactly where the eager reference runs left it: advanced by one eager
    call per size checked, as if the caller had run the step eagerly on verify's inputs
    (the replays consume nothing). ``make_inputs`` runs before the save, so whatever it
    draws is its own.

    Never green on nothing: raises :class:`GraphGuardError` when the runner has no graph
    (before capture, after ``release()``, every size failed under
    ``on_capture_error="skip"``, mode ``"none"``), and :class:`ConfigError` when
    ``make_inputs(n)`` returns a batch that does not replay the size-``n`` graph. The
    inputs are compared too, after both paths: a step that writes its arguments in place
    must leave them as eager does.

    Two input sets per size (``make_inputs(size)`` called twice; the default's second
    batch is one row shorter when that still pads to ``size``), so a Python number the
    graph froze at capture (a length, a position) shows before serving; the report keeps
    the first failing set of each size, else the first.

    Returns a :class:`VerifyReport`: per size, the batch given and the graph replayed.
    """
    kind = type(runner).__name__
    name = f"{kind}({getattr(runner, 'name', '?')})"
    sizes = _check_arguments(runner, name, make_inputs, sizes, rtol, atol, raise_on_fail, seed)
    report = VerifyReport(runner=name)
    captured, todo = _sizes_to_check(name, runner, sizes)
    informative = _check_sizes(runner, name, todo, captured, report, make_inputs, rtol, atol, seed)
    _conclude(name, report, informative, raise_on_fail)
    return report


def _sizes_to_check(
    name: str, runner: Verifiable, sizes: list[int] | None
) -> tuple[tuple[int, ...], list[int]]:
    """The captured sizes, and those to check (``sizes``, default every captured one);
    nothing captured, nothing asked or a size without a graph is refused."""
    captured = tuple(runner.captured_sizes)
    if not captured:
        raise _nothing_to_verify(name, runner)
    if sizes is not None and not list(sizes):
        raise ConfigError(f"{name}: verify(sizes=[]) checks nothing; pass None for every size")
    todo = sorted(set(sizes)) if sizes is not None else list(captured)
    missing = [s for s in todo if s not in captured]
    if missing:
        raise ConfigError(
            f"{name}: verify(sizes=...) asks for {missing}, which have no graph; captured "
            f"{list(captured)}. Pass sizes from runner.captured_sizes."
        )
    return captured, todo


def _check_sizes(
    runner: Verifiable,
    name: str,
    todo: list[int],
    captured: tuple[int, ...],
    report: VerifyReport,
    make_inputs: Callable[[int], Sequence[torch.Tensor]] | None,
    rtol: float | None,
    atol: float | None,
    seed: int,
) -> bool:
    """Two input sets per size of ``todo`` (a number baked at capture shows), the worst
    kept in ``report``; the declared state restored at the end, also on error. Whether
    any eager output had a nonzero element."""
    table = PaddingTable(captured)
    specs = runner.specs
    gen = torch.Generator(device=specs[0].device)
    gen.manual_seed(seed)
    generators = _generators(runner, specs[0].device)
    state: StateLike | None = getattr(runner, "state", None) or None
    snap = state.snapshot() if state is not None else None
    informative = False
    try:
        for size in todo:
            worst: SizeCheck | None = None
            for second in (False, True):  # two input sets: a number baked at capture shows
                check, eager_out = _check_once(
                    runner,
                    name,
                    size,
                    second,
                    make_inputs,
                    specs,
                    table,
                    gen,
                    generators,
                    state,
                    snap,
                    rtol,
                    atol,
                )
                if worst is None or (worst.ok and not check.ok):
                    worst = check
                informative = informative or has_signal(eager_out)
            assert worst is not None
            report.sizes.append(worst)
    finally:
        if state is not None:
            state.restore(snap)
    return informative


def _conclude(name: str, report: VerifyReport, informative: bool, raise_on_fail: bool) -> None:
    """Log the table; warn when every output was zero (agreeing proves nothing); raise
    :class:`DivergenceError` naming the failing sizes when asked."""
    logger.info("%s", report.table())
    if not informative:
        logger.warning(
            "%s: verify compared outputs that are zero at every size, which agree whatever "
            "memory a graph reads (default integer inputs are the fill values, e.g. a "
            "padding token whose embedding is zero); pass make_inputs= with realistic "
            "inputs for a check that can fail",
            name,
        )
    if raise_on_fail and not report.ok:
        raise DivergenceError(
            f"{name}: graph replay diverges from eager at size(s) {report.failed}:\n"
            f"{report.table()}\n"
            "The graph replays what was captured; eager runs the callable again. Likely "
            "causes: the callable branches on Python state that changed since capture "
            "(a counter, a flag, a cache built on the first call), reads a tensor that "
            "was replaced after capture (run with sanitize=True), keeps state the runner "
            "does not know of (declare it so verify restores it), or draws from a "
            "generator verify does not know of (pass it as "
            "options=graphguard.CaptureOptions(generators=[g])). If the difference is "
            "legitimate kernel noise, pass rtol=/atol=.",
            report=report,
        )


__all__ = [
    "SizeCheck",
    "StateLike",
    "Verifiable",
    "VerifyReport",
    "check_inputs",
    "check_size",
    "compare",
    "default_tolerance",
    "owned",
    "verify",
    "within",
]
