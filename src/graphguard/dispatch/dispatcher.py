"""The :class:`Dispatcher`: runs each batch on what the plan decided.

The runners pad by their own size tables and just obey; the dispatcher checks that those
tables are the plan's, and after capture narrows the plan to what captured, so the report
never promises a graph that is not there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from graphguard.config import Mode
from graphguard.dispatch.keys import BatchKey, failed
from graphguard.dispatch.plan import DispatchPlan, _fmt_sizes
from graphguard.errors import ConfigError, InputMismatchError
from graphguard.report import CaptureReport

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
        for kind, r, needed in self._runners(p.mode.has_full, p.mode.has_piecewise):
            sizes = getattr(p, f"{kind}_sizes")
            if r is not None and not (callable(r) and hasattr(r, "sizes")):
                bad += failed([(kind, type(r).__name__, False, runner)])
            elif needed and r is None:
                bad.append(f"mode {p.mode.name} needs a {kind} runner")
            elif needed and r is not None and tuple(r.sizes) != sizes:
                bad.append(
                    f"the {kind} runner's sizes {_fmt_sizes(tuple(r.sizes))} differ from the "
                    f"plan's {kind} sizes {_fmt_sizes(sizes)} (build the runner with "
                    f"sizes=plan.{kind}_sizes)"
                )
        if bad:
            raise ConfigError("Dispatcher: " + "; ".join(bad))
        lead = self.full if self.full is not None else self.piecewise
        specs = getattr(lead, "specs", None)
        self._batch_dim: int = specs[0].batch_dim if specs else 0
        self._targets: dict[Mode, Callable[..., Any]] = {Mode.NONE: self.eager}
        for kind, r, _ in self._runners():
            if r is not None:
                self._targets[Mode(kind)] = r

    def _runners(self, *needed: bool) -> list[tuple[str, _Runner | None, bool]]:
        """``(kind, runner, needed)`` of both kinds, FULL first (the capture order)."""
        flags = needed or (True, True)
        return [("full", self.full, flags[0]), ("piecewise", self.piecewise, flags[1])]

    def capture(self) -> dict[str, CaptureReport]:
        """Capture the FULL runner, then the piecewise one; narrow the plan to what captured."""
        p = self.plan
        got: dict[str, tuple[int, ...] | None] = {}
        short = False
        for kind, r, needed in self._runners(p.mode.has_full, p.mode.has_piecewise):
            if needed and r is not None:
                self.reports[kind] = r.capture()
            got[kind] = tuple(r.captured_sizes) if r is not None else None
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

        runners = [r for _, r, _ in self._runners() if r is not None]
        return update_weights(runners, source, on_moved=on_moved, strict=strict)

    def check_weights(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.check_weights` of each captured runner, by kind."""
        return {
            kind: r.check_weights()  # type: ignore[attr-defined]
            for kind, r, _ in self._runners()
            if r is not None and r.captured_sizes
        }

    def release(self) -> None:
        """Drop the graphs of both runners (calls fail until :meth:`capture` runs again)."""
        for _, r, _ in self._runners():
            if r is not None:
                r.release()
