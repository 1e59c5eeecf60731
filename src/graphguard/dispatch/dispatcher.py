"""The :class:`Dispatcher` runs each batch on what the plan decided; :func:`build_dispatcher`
wires one for a step whose inputs are one row per token (any batch is then ``n`` rows).

The runners pad by their own size tables and just obey; the dispatcher checks that those
tables are the plan's, and after capture narrows the plan to what captured, so the report
never promises a graph that is not there. Every builder mistake is a ConfigError raised
before anything is compiled or captured.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from typing_extensions import Unpack

from graphguard.backend import GraphBackend
from graphguard.config import CaptureKwargs, CaptureOptions, Mode, option_keywords
from graphguard.dispatch.plan import FLAG, BatchKey, DispatchPlan, failed, fmt_sizes
from graphguard.errors import ConfigError, InputMismatchError
from graphguard.ladder import Ladder, start_over
from graphguard.piecewise import PiecewiseRunner
from graphguard.piecewise.split import SplitOp
from graphguard.report import CaptureReport
from graphguard.runner import GraphRunner

logger = logging.getLogger("graphguard")


class _Runner(Protocol):
    """What :class:`Dispatcher` needs from a runner (GraphRunner and PiecewiseRunner fit)."""

    sizes: tuple[int, ...]

    @property
    def captured_sizes(self) -> tuple[int, ...]: ...
    def capture(self) -> CaptureReport: ...
    def release(self) -> None: ...
    def __call__(self, *inputs: Any) -> Any: ...


@dataclass
class Dispatcher:
    """Runs each batch on what ``plan`` decided: the FULL runner, the piecewise one, or eager.

    Call it as ``dispatcher(key, *inputs)`` with the :class:`BatchKey` of the batch.
    """

    plan: DispatchPlan
    eager: Callable[..., Any]
    full: _Runner | None = None
    piecewise: _Runner | None = None
    reports: dict[str, CaptureReport] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = self.plan
        if not isinstance(p, DispatchPlan):
            raise ConfigError(
                f"Dispatcher: plan must be a graphguard.DispatchPlan, got {type(p).__name__}; "
                "e.g. DispatchPlan('full', max_tokens=512)"
            )
        runner = "a runner (a GraphRunner or PiecewiseRunner)"
        bad = failed([("eager", self.eager, callable(self.eager), "a callable")])
        for kind, r, needed in self._runners():
            sizes = getattr(p, f"{kind}_sizes")
            if r is not None and not (callable(r) and hasattr(r, "sizes")):
                bad += failed([(kind, type(r).__name__, False, runner)])
            elif needed and r is None:
                bad.append(f"mode {p.mode.name} needs a {kind} runner")
            elif needed and r is not None and tuple(r.sizes) != sizes:
                bad.append(
                    f"the {kind} runner's sizes {fmt_sizes(tuple(r.sizes))} differ from the "
                    f"plan's {kind} sizes {fmt_sizes(sizes)} (build the runner with "
                    f"sizes=plan.{kind}_sizes)"
                )
        if bad:
            raise ConfigError("Dispatcher: " + "; ".join(bad))
        lead = self.full if self.full is not None else self.piecewise
        specs = getattr(lead, "specs", None)
        self._batch_dim: int = specs[0].batch_dim if specs else 0
        self._planned = p  # the plan as built: a full recapture starts from it again
        self._targets: dict[Mode, Callable[..., Any]] = {Mode.NONE: self.eager}
        for kind, r, _ in self._runners():
            if r is not None:
                self._targets[Mode(kind)] = r

    def _runners(self) -> list[tuple[str, _Runner | None, bool]]:
        """``(kind, runner, whether the plan's mode needs it)``, FULL first (capture order)."""
        m = self.plan.mode
        return [("full", self.full, m.has_full), ("piecewise", self.piecewise, m.has_piecewise)]

    def capture(self) -> dict[str, CaptureReport]:
        """Capture the FULL runner, then the piecewise one; narrow the plan to what captured."""
        p = self.plan
        got: dict[str, tuple[int, ...] | None] = {}
        short = False
        for kind, r, needed in self._runners():
            if needed and r is not None:
                self.reports[kind] = r.capture()
            got[kind] = tuple(r.captured_sizes) if r is not None else None
            if r is not None and getattr(r, "lazy", False):
                got[kind] = getattr(p, f"{kind}_sizes")  # it captures (and refuses) on first use
            short = short or (needed and got[kind] != getattr(p, f"{kind}_sizes"))
        if short:
            self.plan = p.with_sizes(full=got["full"], piecewise=got["piecewise"])
            logger.warning(
                "%s: not every size captured; the plan now is:\n%s", p.name, self.plan.table()
            )
        return self.reports

    def __call__(self, key: BatchKey, *inputs: Any) -> Any:
        """Run the batch ``inputs`` described by ``key`` on what the plan decided.

        A key whose token count disagrees with the first input's batch dimension is an
        error (it would replay a graph captured for another batch layout): one int compare.
        """
        kind = self.plan.resolve(key).kind  # a ConfigError for anything but a BatchKey
        try:
            rows = inputs[0].shape[self._batch_dim]
        except (IndexError, AttributeError, TypeError):
            rows = key.num_tokens
        if rows != key.num_tokens:
            raise InputMismatchError(
                f"{self.plan.name}: the key {key} says {key.num_tokens} tokens, but the first "
                f"input has {rows} rows along dim {self._batch_dim}; build the key from the "
                "batch it describes (BatchKey.decode / BatchKey.mixed with its token count)"
            )
        return self._targets[kind](*inputs)

    def table(self) -> str:
        """The plan table, then per runner: graphs captured, the piecewise runner's pieces,
        split points and compiles, and its capture summary."""
        lines = [self.plan.table()]
        for kind, r, _ in self._runners():
            if r is None:
                continue
            line = f"  {kind}: {len(tuple(r.captured_sizes))}/{len(tuple(r.sizes))} sizes captured"
            describe = getattr(r, "describe", None)
            line += f"; {describe()}" if kind == "piecewise" and callable(describe) else ""
            report = self.reports.get(kind)
            lines.append(line + (f"; {report.summary()}" if report is not None else ""))
        return "\n".join(lines)

    def update_weights(self, source: Any, *, on_moved: str = "raise", strict: bool = True) -> Any:
        """Load new weights once into the model both runners share, then check both
        (:func:`graphguard.weights.update_weights`); one ``WeightUpdate``."""
        from graphguard.weights import update_weights

        doors = [r.door for _, r in self._ladders()]
        return update_weights(doors, source, on_moved=on_moved, strict=strict)

    def refit(self, **kw: Any) -> Any:
        """``with d.refit(): loader(model)`` over both runners' graphs (one verdict for
        the model they share; :meth:`graphguard.GraphRunner.refit`, same keywords)."""
        from graphguard.weights.update import refit

        return refit([r.door for _, r, _ in self._runners() if isinstance(r, Ladder)], **kw)

    def check_weights(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.check_weights` of each captured runner, by kind."""
        return {kind: r.check_weights() for kind, r in self._ladders() if r.captured_sizes}

    def audit(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.audit` of each captured runner, by kind: what each
        of its graphs reads (the piecewise runner's, piece by piece)."""
        return {kind: r.audit() for kind, r in self._ladders() if r.captured_sizes}

    def canary_stats(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.canary_stats` of each runner, by kind."""
        return {kind: r.canary_stats() for kind, r in self._ladders()}

    def verify(self, **kwargs: Any) -> dict[str, Any]:
        """:func:`graphguard.verify` of each captured runner, by kind (the same arguments
        for both; each replays its own sizes against the eager step)."""
        return {kind: r.verify(**kwargs) for kind, r in self._ladders() if r.captured_sizes}

    def recapture(self, *, reason: str, only_moved: bool = False) -> dict[str, CaptureReport]:
        """:meth:`graphguard.GraphRunner.recapture` of each runner, by kind (``reason``
        required; ``only_moved=True``: only the graphs that read a moved tensor). A full
        recapture narrows the plan to what captured, as :meth:`capture` does."""
        if not only_moved:
            for _, r in self._ladders():
                start_over(r, reason)
            self.plan = self._planned  # what capture() narrowed, tried again
            return self.capture()
        return {kind: r.recapture(reason=reason, only_moved=True) for kind, r in self._ladders()}

    def _ladders(self) -> list[tuple[str, Ladder]]:
        """``(kind, runner)`` of each runner this dispatcher holds that is a graphguard
        runner (the serving-time surface; a user's own runner object has none)."""
        return [(kind, r) for kind, r, _ in self._runners() if isinstance(r, Ladder)]

    def stats(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.stats` of each runner, by kind (``"full"``,
        ``"piecewise"``): replays, eager calls, lazy captures, graph memory."""
        return {kind: r.stats() for kind, r in self._ladders()}

    def release(self) -> None:
        """Drop the graphs of both runners (calls fail until :meth:`capture` runs again)."""
        for _, r, _ in self._runners():
            if r is not None:
                r.release()


_SET_HERE = {
    "sizes": "use full_sizes= and piecewise_sizes= (the plan picks each runner's sizes)",
    "max_size": "use max_tokens= (the largest batch the engine schedules)",
    "batch_dims": "inputs are one row per token: dim 0 is the token dimension of every input",
    "backend": "pass backend_factory= (one backend per runner, e.g. graphguard.RecordingBackend)",
}
"""Options the builder sets itself, and what to pass instead."""


def _maybe(f: object) -> bool:
    return f is None or callable(f)


def _as_split_ops(split_ops: Any) -> tuple[SplitOp, ...]:
    """One op (a name, an op: ops are callables) or a list of ops; None is none."""
    if split_ops is None or isinstance(split_ops, (list, tuple)):
        return tuple(split_ops or ())
    if isinstance(split_ops, str) or callable(split_ops):
        return (split_ops,)
    raise ConfigError(
        f"split_ops must be a list of ops ('ns::name', torch.ops.ns.name or a callable), got "
        f"{type(split_ops).__name__}; e.g. split_ops=['mylib::attention']"
    )


def _check_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (list, tuple)) or not example_inputs:
        raise ConfigError(
            "example_inputs must be a non-empty tuple of tensors, one per input of the step "
            f"(one row per token), got {type(example_inputs).__name__}"
        )
    problems = []
    rows: int | None = None
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            problems.append(f"example_inputs[{i}] is a {type(x).__name__}, not a tensor")
        elif x.ndim == 0:
            problems.append(f"example_inputs[{i}] is a 0-d tensor (it needs a token dimension)")
        elif rows is None:
            rows = int(x.shape[0])
        elif int(x.shape[0]) != rows:
            problems.append(
                f"example_inputs[{i}] has {x.shape[0]} rows but example_inputs[0] has {rows}"
            )
    if problems:
        raise ConfigError(
            "build_dispatcher: " + "; ".join(problems) + ". Every input is one row per "
            "token along dim 0 (e.g. token_ids[n], positions[n], slots[n]); per-request "
            "metadata does not fit this builder (use GraphRunner / PiecewiseRunner and "
            "graphguard.Dispatcher directly)"
        )
    return tuple(example_inputs)


@option_keywords
def build_dispatcher(
    step: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    *,
    mode: Mode | str,
    split_ops: Sequence[SplitOp] | SplitOp = (),
    max_tokens: int,
    query_len: int = 1,
    full_sizes: Sequence[int] | None = None,
    piecewise_sizes: Sequence[int] | None = None,
    full_mixed: bool = False,
    eager: Callable[..., Any] | None = None,
    backend_factory: Callable[[], GraphBackend] | None = None,
    fullgraph: bool = True,
    share_outputs: bool = True,
    sanitize: bool | None = None,
    options: CaptureOptions | None = None,
    **kwargs: Unpack[CaptureKwargs],
) -> Dispatcher:
    """A :class:`~graphguard.Dispatcher` running ``step`` in ``mode`` (nothing captured yet).

    ``step`` takes its inputs positionally, one row per token along dim 0; one example
    tensor per input. ``split_ops`` (``"ns::name"`` as registered with ``torch.library``,
    ``torch.ops.ns.name`` or a callable) run eagerly between the piecewise graphs: required
    by the modes with PIECEWISE, ignored (with a warning) by FULL. ``max_tokens``,
    ``query_len``, ``full_sizes``, ``piecewise_sizes``, ``full_mixed``: as for
    :class:`~graphguard.DispatchPlan`. ``eager`` runs what the plan sends to eager (default
    ``step``); ``backend_factory`` makes one backend per runner (default CUDA;
    ``graphguard.RecordingBackend`` runs every mode on a CPU); ``fullgraph`` goes to the
    piecewise ``torch.compile``. ``share_outputs`` and ``sanitize`` go to the FULL runner
    (:class:`~graphguard.GraphRunner`'s keywords; the sanitizer watches whole-callable
    graphs, and pieces always share). ``options`` and the option keywords apply to both
    runners as for :class:`~graphguard.GraphRunner`, except ``sizes``, ``max_size`` and
    ``batch_dims`` (the plan and the layout decide them); ``name`` (default: the step's)
    becomes ``<name>.full`` / ``<name>.piecewise``.
    Then ``d.capture()``, ``print(d.table())``, ``d(BatchKey.decode(reqs, q), *inputs)``.
    """
    m = Mode.parse(mode)
    _refuse_bad_arguments(step, fullgraph, share_outputs, sanitize, backend_factory, eager)
    ops = _as_split_ops(split_ops)
    inputs = _check_inputs(example_inputs)
    given = {**(options.explicit() if isinstance(options, CaptureOptions) else {}), **kwargs}
    for key, fix in _SET_HERE.items():
        if given.get(key) is not None:
            raise ConfigError(f"build_dispatcher does not take {key}=: {fix}")
    opts = CaptureOptions.merge(options, where="build_dispatcher", **kwargs)
    label = opts.name or getattr(step, "__name__", None) or type(step).__name__
    sizes = {"full_sizes": full_sizes, "piecewise_sizes": piecewise_sizes}
    # The plan validates max_tokens, query_len, the sizes and full_mixed (one wording).
    plan = DispatchPlan(
        m, max_tokens=max_tokens, query_len=query_len, full_mixed=full_mixed, name=label, **sizes
    )
    _check_split_ops(m, ops)
    make: Callable[[], GraphBackend | None] = backend_factory or (lambda: None)
    full = piecewise = None
    if m.has_full:
        named = dataclasses.replace(opts, name=f"{label}.full")
        full = GraphRunner(
            step,
            inputs,
            sizes=plan.full_sizes,
            share_outputs=share_outputs,
            sanitize=sanitize,
            backend=make(),
            options=named,
        )
    if m.has_piecewise:
        named = dataclasses.replace(opts, name=f"{label}.piecewise")
        piecewise = PiecewiseRunner(
            step,
            inputs,
            split_ops=ops,
            fullgraph=fullgraph,
            sizes=plan.piecewise_sizes,
            backend=make(),
            options=named,
        )
    eager = eager if eager is not None else step
    return Dispatcher(plan, eager=eager, full=full, piecewise=piecewise)


def _refuse_bad_arguments(
    step: Any, fullgraph: Any, share_outputs: Any, sanitize: Any, backend_factory: Any, eager: Any
) -> None:
    """One :class:`ConfigError` naming every argument of :func:`build_dispatcher` of the
    wrong kind."""
    factory = "a callable returning a GraphBackend (e.g. graphguard.RecordingBackend, the class)"
    bad = failed(
        [
            ("step", step, callable(step), "a callable"),
            ("fullgraph", fullgraph, isinstance(fullgraph, bool), FLAG),
            ("share_outputs", share_outputs, isinstance(share_outputs, bool), FLAG),
            ("sanitize", sanitize, sanitize is None or isinstance(sanitize, bool), FLAG),
            ("backend_factory", backend_factory, _maybe(backend_factory), factory),
            ("eager", eager, _maybe(eager), "a callable (default: the step)"),
        ]
    )
    if bad:
        raise ConfigError("build_dispatcher: " + "; ".join(bad))


def _check_split_ops(m: Mode, ops: Sequence[SplitOp]) -> None:
    """A mode with PIECEWISE needs split ops; FULL ignores them (said once)."""
    if m.has_piecewise and not ops:
        raise ConfigError(
            f"mode {m.name} needs split_ops: the ops that run eagerly between the piecewise "
            "graphs (e.g. split_ops=['mylib::attention'], your attention op as registered "
            "with torch.library). Without any, use mode='full'"
        )
    if m is Mode.FULL and ops:
        logger.warning(
            "build_dispatcher: split_ops %s are ignored in mode FULL (FULL graphs capture "
            "the whole step, split ops included); use mode='full_and_piecewise' to run "
            "mixed batches on piecewise graphs",
            [str(o) for o in ops],
        )
