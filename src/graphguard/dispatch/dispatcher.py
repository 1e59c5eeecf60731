"""The :class:`Dispatcher`: runs each batch on what the plan decided.

The runners (:class:`~graphguard.GraphRunner`, :class:`~graphguard.PiecewiseRunner`) pad
by their own size tables and just obey; the dispatcher checks that those tables are the
plan's, and after capture narrows the plan to what captured, so the report never promises
a graph that is not there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from graphguard.config import Mode
from graphguard.dispatch.keys import BatchKey
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
        if not isinstance(self.plan, DispatchPlan):
            raise ConfigError(
                f"Dispatcher: plan must be a graphguard.DispatchPlan, got "
                f"{type(self.plan).__name__}; e.g. DispatchPlan('full', max_tokens=512)"
            )
        problems = (
            [] if callable(self.eager) else [f"eager must be a callable, got {self.eager!r:.60}"]
        )
        for kind, runner, sizes, needed in (
            ("full", self.full, self.plan.full_sizes, self.plan.mode.has_full),
            ("piecewise", self.piecewise, self.plan.piecewise_sizes, self.plan.mode.has_piecewise),
        ):
            if runner is not None and not (callable(runner) and hasattr(runner, "sizes")):
                problems.append(
                    f"{kind} must be a runner (a GraphRunner or PiecewiseRunner), got "
                    f"{type(runner).__name__}"
                )
            elif needed and runner is None:
                problems.append(f"mode {self.plan.mode.name} needs a {kind} runner")
            elif needed and runner is not None and tuple(runner.sizes) != sizes:
                problems.append(
                    f"the {kind} runner's sizes {_fmt_sizes(tuple(runner.sizes))} differ from "
                    f"the plan's {kind} sizes {_fmt_sizes(sizes)} (build the runner with "
                    f"sizes=plan.{kind}_sizes)"
                )
        if problems:
            raise ConfigError("Dispatcher: " + "; ".join(problems))
        lead = self.full if self.full is not None else self.piecewise
        specs = getattr(lead, "specs", None)
        self._batch_dim: int = specs[0].batch_dim if specs else 0
        self._targets: dict[Mode, Callable[..., Any]] = {Mode.NONE: self.eager}
        if self.full is not None:
            self._targets[Mode.FULL] = self.full
        if self.piecewise is not None:
            self._targets[Mode.PIECEWISE] = self.piecewise

    def capture(self) -> dict[str, CaptureReport]:
        """Capture the FULL runner, then the piecewise one; narrow the plan to what captured."""
        mode = self.plan.mode
        if mode.has_full and self.full is not None:
            self.reports["full"] = self.full.capture()
        if mode.has_piecewise and self.piecewise is not None:
            self.reports["piecewise"] = self.piecewise.capture()
        full = tuple(self.full.captured_sizes) if self.full is not None else None
        pw = tuple(self.piecewise.captured_sizes) if self.piecewise is not None else None
        if (mode.has_full and full != self.plan.full_sizes) or (
            mode.has_piecewise and pw != self.plan.piecewise_sizes
        ):
            self.plan = self.plan.with_sizes(full=full, piecewise=pw)
            logger.warning(
                "%s: not every size captured; the plan now is:\n%s",
                self.plan.name,
                self.plan.table(),
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
        """The plan table, then one line per runner: graphs captured, and for the
        piecewise runner its pieces, split points and compiles."""
        lines = [self.plan.table()]
        for kind, runner in (("full", self.full), ("piecewise", self.piecewise)):
            if runner is None:
                continue
            done, total = len(tuple(runner.captured_sizes)), len(tuple(runner.sizes))
            line = f"  {kind}: {done}/{total} sizes captured"
            describe = getattr(runner, "describe", None)
            if kind == "piecewise" and callable(describe):
                line += f"; {describe()}"
            report = self.reports.get(kind)
            if report is not None:
                line += f"; {report.summary()}"
            lines.append(line)
        return "\n".join(lines)

    def update_weights(self, source: Any, *, on_moved: str = "raise", strict: bool = True) -> Any:
        """Load new weights once into the model both runners share, then check both
        (:meth:`graphguard.GraphRunner.update_weights`; a runner with a module of its
        own gets its own copy). Returns one :class:`~graphguard.weights.WeightUpdate`."""
        from graphguard.weights import update_weights

        runners = [r for r in (self.full, self.piecewise) if r is not None]
        return update_weights(runners, source, on_moved=on_moved, strict=strict)

    def check_weights(self) -> dict[str, Any]:
        """:meth:`graphguard.GraphRunner.check_weights` of each captured runner, by kind."""
        return {
            kind: r.check_weights()  # type: ignore[attr-defined]
            for kind, r in (("full", self.full), ("piecewise", self.piecewise))
            if r is not None and r.captured_sizes
        }

    def release(self) -> None:
        """Drop the graphs of both runners (calls fail until :meth:`capture` runs again)."""
        for runner in (self.full, self.piecewise):
            if runner is not None:
                runner.release()
