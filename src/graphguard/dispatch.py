"""One place decides which graph runs a batch: FULL, PIECEWISE or eager.

An engine step is described by a :class:`BatchKey` (how many tokens, how many
requests, and whether every request has the same query length). A
:class:`DispatchPlan` is built once from the mode and the capture sizes; it
precomputes a :class:`Decision` for every token count up to ``max_tokens``, so
:meth:`DispatchPlan.resolve` is one list index on the serving path. The wrappers
(:class:`~graphguard.GraphRunner`, :class:`~graphguard.PiecewiseRunner`)
just obey; :class:`Dispatcher` ties them together.

The fallback order is the key's *relaxation*: a uniform-decode key is first offered to
the FULL graphs (captured for uniform batches of exactly ``query_len`` tokens per
request), then relaxed to a tokens-only key offered to the PIECEWISE graphs (keyed by
the token count alone, because the split ops run eagerly on the real batch layout),
then the batch runs eagerly.

Every place where what runs is not the best the mode offers is a *downgrade*. The plan
lists them before anything is captured (:meth:`DispatchPlan.table`,
:meth:`DispatchPlan.to_dict`), and each one is logged once, so nobody learns about
an eager fallback from a latency graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from graphguard.config import Mode
from graphguard.errors import ConfigError, InputMismatchError
from graphguard.keys import BatchKey, Decision, PlanRow
from graphguard.keys import _is_int as _is_int  # graphguard.builder imports it from here
from graphguard.plan import DispatchPlan, _fmt_sizes
from graphguard.report import CaptureReport

logger = logging.getLogger("graphguard")

# Re-exported: BatchKey, Decision, PlanRow live in graphguard.keys, DispatchPlan in
# graphguard.plan; ``from graphguard.dispatch import ...`` keeps working for all of them.
__all__ = ["BatchKey", "Decision", "DispatchPlan", "Dispatcher", "PlanRow"]


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
    """Runs each batch on what the plan decided: the FULL runner, the piecewise runner, or eager.

    The runners pad by their own size tables; the dispatcher checks at construction
    that those are the plan's sizes, and after :meth:`capture` narrows the plan to the
    sizes that actually captured, so the plan report never promises a graph that is
    not there.
    """

    plan: DispatchPlan
    eager: Callable[..., Any]
    full: _Runner | None = None
    piecewise: _Runner | None = None
    reports: dict[str, CaptureReport] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for kind, runner, sizes, needed in (
            ("full", self.full, self.plan.full_sizes, self.plan.mode.has_full),
            ("piecewise", self.piecewise, self.plan.piecewise_sizes, self.plan.mode.has_piecewise),
        ):
            if needed and runner is None:
                problems.append(f"mode {self.plan.mode.name} needs a {kind} runner")
            elif needed and runner is not None and tuple(runner.sizes) != tuple(sizes):
                problems.append(
                    f"the {kind} runner's sizes {_fmt_sizes(tuple(runner.sizes))} differ from "
                    f"the plan's {kind} sizes {_fmt_sizes(sizes)}"
                )
        if problems:
            raise ConfigError("Dispatcher: " + "; ".join(problems))
        lead = next((r for r in (self.full, self.piecewise) if r is not None), None)
        specs = getattr(lead, "specs", None)
        self._batch_dim: int = specs[0].batch_dim if specs else 0
        self._targets: dict[Mode, Callable[..., Any]] = {Mode.NONE: self.eager}
        if self.full is not None:
            self._targets[Mode.FULL] = self.full
        if self.piecewise is not None:
            self._targets[Mode.PIECEWISE] = self.piecewise

    def capture(self) -> dict[str, CaptureReport]:
        """Capture the FULL runner, then the piecewise one; narrow the plan to what captured."""
        if self.plan.mode.has_full and self.full is not None:
            self.reports["full"] = self.full.capture()
        if self.plan.mode.has_piecewise and self.piecewise is not None:
            self.reports["piecewise"] = self.piecewise.capture()
        full = tuple(self.full.captured_sizes) if self.full is not None else None
        pw = tuple(self.piecewise.captured_sizes) if self.piecewise is not None else None
        if (self.plan.mode.has_full and full != self.plan.full_sizes) or (
            self.plan.mode.has_piecewise and pw != self.plan.piecewise_sizes
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
        error (it would replay a graph captured for another batch layout); one int
        compare, skipped for inputs that are not tensors.
        """
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
        return self._targets[self.plan.resolve(key).kind](*inputs)

    def table(self) -> str:
        """The plan table, then one section per runner: graphs captured, and for the
        piecewise runner its pieces, split points and compiles."""
        lines = [self.plan.table()]
        for kind, runner in (("full", self.full), ("piecewise", self.piecewise)):
            if runner is None:
                continue
            sizes = tuple(runner.sizes)
            captured = tuple(runner.captured_sizes)
            line = f"  {kind}: {len(captured)}/{len(sizes)} sizes captured"
            describe = getattr(runner, "describe", None)
            if kind == "piecewise" and callable(describe):
                line += f"; {describe()}"
            report = self.reports.get(kind)
            if report is not None:
                line += f"; {report.summary()}"
            lines.append(line)
        return "\n".join(lines)

    def describe(self) -> str:
        """Same as :meth:`table`."""
        return self.table()

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
