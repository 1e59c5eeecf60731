"""The replay canary: every Nth replay of each batch size shadowed eagerly, while serving.

:func:`~graphguard.verify` compares graphs with eager once, before serving, on inputs
graphguard makes up. A graph can still go wrong later, silently: a Python number baked
at capture that the host since changed, a weight or state buffer re-created at a new
address, real rows that read padded rows. The canary (``canary=Canary(...)``, an option
of every runner) watches values on real traffic:

1. Every ``every``-th call of a batch size ``n`` (one integer decrement and compare per
   call on the hot path: :attr:`Entry.countdown <graphguard.ladder.Entry>`), the declared
   state (:class:`~graphguard.StateSet`) and the registered generators are saved, the
   graph replays as usual (its padded rows poisoned, with ``poison_padding``), and what the
   replay left in the state and generators is saved too.
2. State and generators go back to the pre-replay snapshot; the callable runs eagerly on
   a copy of the caller's ``n`` real rows; outputs (the graph's narrowed to ``n``), written
   inputs and every state tensor are compared with :func:`graphguard.verify`'s per-dtype
   tolerance (:func:`~graphguard.verify.default_tolerance`).
3. State and generators are put back to what the replay produced: the caller sees
   exactly what a plain call leaves (outputs, state, generator offsets).

Cost, on the checked call only: one eager step, two clones of the declared state (the
pre- and post-replay snapshots: ``2 x`` its bytes of device memory and copy time, freed at
the end of the call) and one host sync for the comparison. Declare only what the step
writes (the rows and counters it updates; a :class:`~graphguard.StateSet` of views of a
KV cache's active slots), not a whole cache: a 10 GiB cache cloned twice every N steps is
a cost the canary cannot hide.

Poisoned arenas (``poison_arenas``, on with ``sanitize=True``): capture fills the arenas
it locks with NaN, once, so a replay that reads scratch it did not write shows as a
divergence at the next check (or in ``verify()``); nothing is added to the replay path.

Refused (:class:`~graphguard.errors.ConfigError` from ``capture()``, and every later call
raises it too): a step that writes tensors outside its inputs with no ``state=`` declared,
since the shadow run would apply those writes a second time; and a step whose writes
graphguard cannot see (``warmup_iters=0``, a compiled step) with no ``state=``. Declare
the state, or ``state=[]`` when the writes are harmless to repeat.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphguard.entries import Entry, copy_into
from graphguard.errors import ConfigError, DivergenceError
from graphguard.options import Canary, OnDivergence
from graphguard.report import CaptureReport, SizeCheck, VerifyReport
from graphguard.rng import GeneratorStates
from graphguard.serving import Agreement, Door
from graphguard.state import StateSet
from graphguard.verify import (
    check_inputs,
    check_size,
    compare,
    default_tolerance,
    owned,
    within,
)

logger = logging.getLogger("graphguard")


def poisons_arenas(canary: Canary | None, sanitize: bool | None) -> bool:
    """Whether a runner's capture fills its arenas with NaN at the lock: the canary's
    ``poison_arenas`` when set, else the sanitizer switch (as for ``poison_padding``)."""
    if canary is not None and canary.poison_arenas is not None:
        return canary.poison_arenas
    return bool(sanitize)


@dataclass
class CanaryStats:
    """What the canary saw for one captured size (``runner.canary_stats()[size]``)."""

    checks: int = 0
    divergences: int = 0
    last: VerifyReport | None = None
    """The report of the last divergence (``None``: none yet)."""
    eager: bool = False
    """Served eagerly since a divergence (``on_divergence="eager"``)."""
    max_abs: float = 0.0
    """The largest max-abs difference of any check, passed or not (outputs, written
    inputs and state): how close to the tolerance serving runs; ``inf`` once a check
    could not compare (a NaN against a number, a shape, a raising shadow run)."""
    max_rel: float = 0.0
    """The largest max-rel difference of any check's outputs (``|a - b| / (|b| + atol)``)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["last"] = self.last.to_dict() if self.last is not None else None
        return d


def _poison(dtype: torch.dtype) -> float | int | None:
    """NaN for floats, the dtype's max for integers (out of range for any index); bools
    have no out-of-range value."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return None
    return int(torch.iinfo(dtype).max)


@dataclass
class CanaryWatch:
    """A runner's canary: the counters' reset value, stats, the sizes served eagerly,
    the poisoned fills; :meth:`call` is the checked call. It reaches its runner only
    through the runner's :class:`~graphguard.serving.Door`."""

    door: Door
    canary: Canary
    poison_default: bool = False
    """Poison float inputs' padding when ``Canary.poison_padding`` is None (the runner's
    ``sanitize``)."""
    agreement: Agreement | None = None
    """Under TP: every rank's verdict all-reduced, so all ranks warn, raise or go eager
    together."""
    state: StateSet | None = None
    """The declared state (``state=``): cloned around each check."""
    stats: dict[int, CanaryStats] = field(default_factory=dict)
    refused: str | None = None
    _demoted: set[int] = field(default_factory=set)
    _judged: bool = False
    _poison_full: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        want = self.canary.poison_padding
        if isinstance(want, tuple):
            inputs = [s.name for s in self.door.static.specs]
            unknown = sorted(set(want) - set(inputs))
            if unknown:
                raise ConfigError(
                    f"{self.door.label}: Canary(poison_padding={list(want)!r}) names "
                    f"{unknown}, which are not inputs; the inputs are {inputs} (names=...)"
                )

    # ------------------------------------------------------------- lifecycle

    def arm(self, entries: Sequence[Entry | None]) -> None:
        """Set every entry's countdown (1: every call comes here: refused or eager)."""
        for e in entries:
            if e is not None:
                eager = self.refused is not None or e.size in self._demoted
                e.rearm(1 if eager else self.canary.every)

    def judge(self, report: CaptureReport, declared: Any, *, fresh: bool = False) -> None:
        """The verdict on the step's undeclared writes, from the first capture that
        watched a warmup (``fresh``: a new ``capture()``, judge again). A lazy runner's
        stage captures nothing unless ``capture_now``, so its first lazy capture decides;
        until then the counters are armed and the verdict waits."""
        if fresh:
            self._judged = False
        if self._judged:
            return
        if report.state_writes is None and not report.captured:
            self.after_capture(report, [])  # armed; the verdict waits for a warmup
            return
        self._judged = True
        self.after_capture(report, declared)

    def after_capture(self, report: CaptureReport, declared: Any) -> None:
        """A (re)capture: new graphs get a new chance (sizes served eagerly replay
        again); then refuse a step whose undeclared writes the shadow run would apply
        twice."""
        r = self.door
        self._demoted.clear()
        self.refused = None
        for st in self.stats.values():
            st.eager = False
        self.arm(r.entries)
        if declared is not None:
            return
        if report.state_writes is None:
            why = (
                "graphguard cannot see whether the step writes tensors outside its inputs "
                "(no warmup watched it: warmup_iters=0 or a compiled step)"
            )
        elif report.state_writes:
            why = f"the step writes {', '.join(report.state_writes[:4])}"
        else:
            return
        self.refused = (
            f"{r.label}: canary refused: {why}, and no state= is declared, so the eager "
            "shadow run would apply those writes a second time and change what the step "
            "computes. Declare what it writes (state=[...], only the rows and counters "
            "written: the canary clones it twice per check), or state=[] when repeating "
            "the writes is harmless."
        )
        self.arm(r.entries)
        raise ConfigError(self.refused)

    def stats_table(self) -> dict[int, CanaryStats]:
        """Per captured size (each listed from capture on)."""
        for size in self.door.captured_sizes:
            self.stats.setdefault(size, CanaryStats())
        return dict(sorted(self.stats.items()))

    # ------------------------------------------------------------ the check

    def _poisoned(self, e: Entry) -> Entry | None:
        """``e`` with its padded rows' sources poisoned (None: nothing to poison)."""
        r = self.door
        want = self.canary.poison_padding
        if want is None:
            want = self.poison_default
            floats_only = True
        else:
            floats_only = False
        if want is False or e.n == r.static.max_size:
            return None
        if self._poison_full is None:
            named = None if isinstance(want, bool) else set(want)
            full: list[torch.Tensor | None] = []
            for s, buf in zip(r.static.specs, r.static.buffers):
                value = _poison(s.dtype)
                skip = (named is not None and s.name not in named) or (
                    floats_only and not (s.dtype.is_floating_point or s.dtype.is_complex)
                )
                full.append(None if value is None or skip else torch.full_like(buf, value))
            self._poison_full = full
        if not any(p is not None for p in self._poison_full):
            return None
        k = r.static.max_size - e.n
        srcs = [
            src if p is None else p.narrow(s.batch_dim, e.n, k)
            for src, p, s in zip(e.tail_srcs, self._poison_full, r.static.specs)
        ]
        shadow = type(e)(**{k: getattr(e, k) for k in type(e).__slots__})
        shadow.tail_srcs = srcs
        return shadow

    def call(self, e: Entry, inputs: tuple[Any, ...] | None) -> Any:
        """The checked call: ``inputs`` from ``runner(*inputs)``, None from ``replay(n)``."""
        r = self.door
        if self.refused is not None:
            raise ConfigError(self.refused)
        if e.size in self._demoted:
            e.rearm(1)
            return r.eager(*(inputs if inputs is not None else e.dsts))
        e.rearm(self.canary.every)
        if inputs is not None:
            try:
                copy_into(e.dsts, inputs)
            except RuntimeError as exc:
                e.rearm(1)  # the detached retry is the checked call
                return r.replay_detached(inputs, exc)
        rows = inputs if inputs is not None else tuple(e.dsts)
        eager_in = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in rows)
        state = self.state or None
        generators = [g for _, g in r.generators()]
        pre = state.snapshot() if state is not None else None
        rng_pre = GeneratorStates(generators)
        c = self.canary
        probe_out, probe_state, trouble = None, None, ""
        shadow = self._poisoned(e)
        if shadow is not None:
            # A shadow replay with poisoned padding, compared below; then everything goes
            # back and the caller gets a replay with the harmless fills.
            try:  # refilled: the poison goes in now, and out again after
                probe_out = owned(r.replay_entry(shadow, None, refill=True))
            except Exception as exc:  # e.g. a poisoned index out of range (CPU emulation)
                trouble = f"the replay with poisoned padding raised: {exc}"
            probe_state = state.snapshot() if state is not None else None
            self._restore(state, pre, rng_pre)
            copy_into(e.dsts, eager_in)  # in case the step writes its inputs
        out = r.replay_entry(e, inputs)
        replay_out = probe_out if shadow is not None else owned(out)
        post = state.snapshot() if state is not None else None
        rng_post = GeneratorStates(generators)
        self._restore(state, pre, rng_pre)
        try:
            eager_out = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, r.eager(*eager_in))
        except Exception as exc:
            eager_out, trouble = None, trouble or f"the eager shadow run raised: {exc}"
        if trouble or eager_out is None:
            check = self._failed(e, trouble)
        else:
            check = check_size(e.size, replay_out, eager_out, c.rtol, c.atol)
            check.batch, check.graph = e.n, e.size
            check_inputs(check, r.static.specs, rows, eager_in, c.rtol, c.atol)
            replayed = probe_state if probe_state is not None else post
            if replayed is not None:
                self._check_state(check, replayed)
        eager_wins = not check.ok and c.on_divergence == "eager" and eager_out is not None
        if not eager_wins:
            self._restore(state, post, rng_post)
        elif e.writeback:  # the caller's written inputs as eager left them
            for i in e.writeback:
                rows[i].copy_(eager_in[i])
        return self._verdict(e, check, out, eager_out)

    @staticmethod
    def _restore(state: Any, snap: Any, rng: GeneratorStates) -> None:
        if state is not None and snap is not None:
            state.restore(snap)
        rng.restore()

    def _failed(self, e: Entry, note: str) -> SizeCheck:
        inf = math.inf
        return SizeCheck(
            size=e.size,
            dtype="-",
            max_abs=inf,
            max_rel=inf,
            rtol=0.0,
            atol=0.0,
            ok=False,
            note=note[:300],
            batch=e.n,
            graph=e.size,
        )

    def _check_state(self, check: SizeCheck, post: Any) -> None:
        """Each state tensor as eager left it against what the replay left (``post``)."""
        c = self.canary
        for name, now, replayed in zip(post.names, post.tensors, post.clones):
            r0, a0 = default_tolerance(now.dtype)
            rt = c.rtol if c.rtol is not None else r0
            at = c.atol if c.atol is not None else a0
            if now.shape != replayed.shape or not within(replayed, now, rt, at):
                check.ok = False
                check.max_abs = max(check.max_abs, compare(replayed, now)[0])
                check.note = check.note or f"state {name} after the call differs from eager's"

    def _verdict(self, e: Entry, check: SizeCheck, out: Any, eager_out: Any) -> Any:
        """Count the check; on a divergence, do what ``on_divergence`` says."""
        stats = self.stats.setdefault(e.size, CanaryStats())
        stats.checks += 1
        stats.max_abs = max(stats.max_abs, check.max_abs)
        stats.max_rel = max(stats.max_rel, check.max_rel)
        diverged = not check.ok
        if self.agreement is not None:
            diverged = self.agreement.agree_divergence(diverged)
            if diverged and check.ok:
                check.ok, check.note = False, "another rank diverged"
        if not diverged:
            return out
        r = self.door
        report = VerifyReport(runner=r.label, sizes=[check])
        stats.divergences += 1
        stats.last = report
        how = self.canary.on_divergence
        if callable(how):
            how(report)
            return out
        if how == "raise":
            raise DivergenceError(
                f"{r.label}: canary: the graph of size {e.size} diverges from eager on a "
                f"batch of {e.n} (call checked every {self.canary.every}):\n{report.table()}\n"
                "The caller's state is the graph's (as a plain call leaves it). Run "
                "verify() and the sanitizer (sanitize=True) to find why; "
                "Canary(on_divergence='eager') serves the size eagerly instead.",
                report=report,
            )
        if how == "eager":
            self._demoted.add(e.size)
            stats.eager = True
            self.arm(r.entries)
            logger.warning(
                "%s: canary: the graph of size %d diverges from eager; serving batches "
                "padded to %d eagerly from now on (correct, slower; said once):\n%s",
                r.label,
                e.size,
                e.size,
                report.table(),
            )
            return eager_out if eager_out is not None else out
        if stats.divergences == 1:
            logger.warning(
                "%s: canary: the graph of size %d diverges from eager (logged once per "
                "size; runner.canary_stats() counts them):\n%s",
                r.label,
                e.size,
                report.table(),
            )
        return out


__all__ = ["Canary", "CanaryStats", "CanaryWatch", "OnDivergence", "poisons_arenas"]
