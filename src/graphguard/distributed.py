"""Graphs with collectives inside: capture and replay across tensor-parallel ranks.

A collective completes only when every rank of the group launches the matching one,
so ranks that capture different ladders, or replay different graphs, hang with no
message. :class:`DistributedGraphRunner` wraps a :class:`~graphguard.runner.GraphRunner`
and makes the ranks agree: before capture (barrier, plan comparison, communicator
warm-up), during capture (a check-in before each size) and at each call (one CPU
all-reduce of the batch size, or ``agree="trust"``). Each disagreement is an error
naming the rank(s) (:mod:`graphguard.errors`: :class:`DistributedError`,
:class:`BatchMismatchError`, :class:`CapturePlanMismatchError`,
:class:`DistributedCaptureError`) instead of a hang. Capture error mode defaults to
``"thread_local"`` (NCCL's watchdog thread queries events). The reasoning, costs and
what stays a hang: ``docs/distributed.md``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Unpack

from graphguard import phase
from graphguard._ranks import Ranks, capture_plan, rank_logging, seconds
from graphguard._ranks import control_group as control_group_of
from graphguard.arguments import check_keywords
from graphguard.backend import GraphBackend
from graphguard.buffers import input_mismatches
from graphguard.errors import (
    BatchMismatchError,
    CapturePlanMismatchError,
    ConfigError,
    DistributedCaptureError,
    DistributedError,
)
from graphguard.keywords import CaptureKwargs, option_keywords, runner_keywords
from graphguard.ladder import start_over
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
from graphguard.phase import Phase
from graphguard.report import CaptureReport
from graphguard.runner import GraphRunner
from graphguard.verify import verify
from graphguard.weights.update import WeightUpdate, update_weights

logger = logging.getLogger("graphguard")

AGREE_MODES = ("allreduce", "trust")
MISMATCH_POLICIES = ("raise", "pad")


class DistributedGraphRunner:
    """A :class:`GraphRunner` whose ranks capture and replay the same graphs.

    Every rank of ``group`` must construct it (it creates a gloo control group, a
    collective) with the same ladder, call :meth:`capture`, and call it once per step.

    Args:
        fn, example_inputs: as for :class:`GraphRunner`; ``fn`` runs the rank's shard and
            its collectives (e.g. :class:`graphguard_ref.tp.TensorParallelLlama`).
        group: the process group the model's collectives run on (default: the world).
        control_group: a gloo group over the same ranks for the CPU-side agreement,
            barriers and check-ins; by default one is created with ``timeout``.
        agree: ``"allreduce"`` (agree on the batch size every call; a host round-trip,
            see the module docstring) or ``"trust"`` (the engine guarantees equal
            batches on every rank; no per-call collective).
        on_mismatch: with ``agree="allreduce"``, what a step with different batch sizes
            does: ``"raise"`` (:class:`BatchMismatchError` on every rank) or ``"pad"``
            (every rank replays the graph of the largest batch).
        timeout: seconds (or a timedelta) a rank waits for its peers at a barrier,
            check-in or agreement before raising an error naming the rank(s).
        mode, compile, share_outputs, sanitize, options, backend: as for
            :class:`GraphRunner` (passed to the rank's runner).
        every option keyword (:class:`~graphguard.CaptureOptions`): as for
            :class:`GraphRunner`, with two defaults of its own, taken only where the
            caller set nothing: ``capture_error_mode="thread_local"`` (see the module
            docstring) and the progress bar on the first rank only.
            ``on_capture_error="skip"`` is refused: a size skipped on one rank only
            would leave the ladders different. ``canary=``: every rank checks the same
            calls (the counters count calls, which all ranks make in lockstep), and the
            eager shadow run executes the step's collectives on every rank together;
            the verdicts are all-reduced, so all ranks warn, raise or go eager at once.
    """

    @option_keywords
    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        agree: str = "allreduce",
        on_mismatch: str = "raise",
        timeout: float | datetime.timedelta = 60.0,
        mode: Mode | str = Mode.FULL,
        compile: bool = False,
        share_outputs: bool = True,
        sanitize: bool | None = None,
        options: CaptureOptions | None = None,
        backend: GraphBackend | None = None,
        **kwargs: Unpack[CaptureKwargs],
    ) -> None:
        check_keywords(
            type(self).__name__, kwargs, runner_keywords(DistributedGraphRunner.__init__)
        )
        opts = _checked_options(agree, on_mismatch, options, kwargs)
        self.group = group
        self.rank = dist.get_rank()
        self.group_ranks: list[int] = list(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.world_size = len(self.group_ranks)
        self.timeout = seconds(timeout)
        self.agree = agree
        self.on_mismatch = on_mismatch
        self.user_fn = fn
        self.control_group = control_group or control_group_of(
            self.group_ranks, self.timeout, f"rank {self.rank}"
        )
        self.ranks = Ranks(self.rank, self.group_ranks, group, self.control_group, self.timeout)
        opts = _rank_defaults(opts, fn, first=self.rank == self.group_ranks[0])
        # This wrapper is the runner's Agreement: every rank acts on any rank's canary
        # divergence, and captures a lazy size or none (graphguard.serving).
        self.runner = GraphRunner(
            self._fn,
            example_inputs,
            mode=mode,
            compile=compile,
            share_outputs=share_outputs,
            sanitize=sanitize,
            options=opts,
            backend=backend,
            agreement=self,
        )
        self.name = self.runner.name
        self._lead_dim = self.runner.specs[0].batch_dim
        # The agreement buffer: [n, -n] all-reduced with MAX gives (max, -min) at once.
        self._agree_buf = torch.zeros(2, dtype=torch.int64)
        self._step = 0
        self._capturing = False
        self._checked_in: set[int] = set()
        self.report: CaptureReport | None = None
        self.capture_times: dict[str, float] = {}
        """Wall seconds of the last successful :meth:`capture`: ``agree_before_s``
        (barriers, plan comparison, communicator warm-up), ``ladder_s`` (the wrapped
        runner's capture, per-size check-ins included) and ``agree_after_s``."""

    # ---------------------------------------------------------------- capture

    def capture_signature(self) -> dict[str, Any]:
        """This rank's capture signature: what every rank must agree on before capturing.

        Sizes in capture order (largest first), mode, warmup count, error mode, and each
        input's dtype, batch dim and trailing shape; ``hash`` digests all of it.
        """
        return capture_plan(self.runner)

    def capture(self) -> CaptureReport:
        """Agree, synchronize, capture the same ladder on every rank, agree again.

        Every rank must call it. Returns this rank's report (printed by rank 0 only, see
        :meth:`log_report`). Raises :class:`CapturePlanMismatchError`,
        :class:`DistributedCaptureError` or :class:`DistributedError` on every rank,
        each naming the rank(s) at fault.
        """
        with rank_logging(self.rank):
            t0 = time.perf_counter()
            ranks = self.ranks
            ranks.barrier("before comparing capture plans")
            ranks.verify_plans(self.capture_signature())
            ranks.warm_communicator(self.runner.specs[0].device)
            self._synchronize()
            ranks.barrier("before capture")
            t1 = time.perf_counter()
            self._capturing = True
            self._checked_in.clear()
            ranks.peer_failures.clear()
            try:
                report = self.runner.capture()
                t2 = time.perf_counter()
                self._capturing = False
                statuses = ranks.checkin(("done", list(report.captured)), "after capture")
                self.capture_times = {
                    "agree_before_s": t1 - t0,
                    "ladder_s": t2 - t1,
                    "agree_after_s": time.perf_counter() - t2,
                }
            except BaseException as exc:
                self._capturing = False
                self._after_failed_capture(exc)
                raise  # pragma: no cover - _after_failed_capture always raises
            mismatch = ranks.ladder_mismatch(statuses)
            if mismatch is not None:
                self.runner.release()
                raise mismatch
            self.report = report
            if self.rank == self.group_ranks[0] and report.sizes:
                logger.info("%s: every rank captured %s", self.name, report.captured)
        return report

    def _after_failed_capture(self, exc: BaseException) -> None:
        """Tell the peers (unless they told us), release the graphs, raise naming ranks."""
        self.runner.release()
        raise self.ranks.capture_failure(exc) from exc

    def _fn(self, *args: Any) -> Any:
        """The captured callable: a check-in before each size's first warmup, then ``fn``."""
        if self._capturing and phase.current_phase() is Phase.WARMUP:
            size = int(args[0].shape[self._lead_dim])
            if size not in self._checked_in:
                self._checked_in.add(size)
                self.ranks.checkin(("ok", size), f"before warming up size {size}")
        return self.user_fn(*args)

    def _synchronize(self) -> None:
        device = self.runner.specs[0].device
        if self.runner.mode is not Mode.NONE:
            self.runner.backend.synchronize()
        elif device.type == "cuda":
            torch.cuda.synchronize(device)

    # ----------------------------------------------------------------- replay

    def agree_batch(self, n: int) -> tuple[int, int]:
        """All ranks' (smallest, largest) batch size of this step (one CPU all-reduce).

        Public for engines with their own input path (e.g. the zero-copy
        ``static_inputs``/``replay`` pair): replay the largest, padded.
        """
        buf = self._agree_buf
        buf[0] = n
        buf[1] = -n
        self._step += 1
        hi, neg_lo = self.ranks.max_all_reduce(
            buf, f"the batch size of step {self._step} (mine: {n})"
        )
        return -int(neg_lo), int(hi)

    def agree_divergence(self, diverged: bool) -> bool:
        """Whether any rank's canary check diverged (one CPU all-reduce, on checked calls
        only: every rank checks the same call, since counters count calls in lockstep)."""
        buf = torch.tensor([int(diverged)], dtype=torch.int64)
        return bool(self.ranks.max_all_reduce(buf, "a canary check's verdict")[0])

    def agree_lazy(self, stage: str, size: int, ok: bool) -> bool:
        """Whether every rank is ok to capture (``stage`` "start") or kept (``"done"``) the
        same lazy size (one CPU all-reduce; every rank reaches it in the same call, since
        the batches agree). Different sizes on the ranks are a :class:`DistributedError`."""
        buf = torch.tensor([size, -size, int(not ok)], dtype=torch.int64)
        hi, neg_lo, bad = self.ranks.max_all_reduce(
            buf, f"the lazy capture of size {size} ({stage})"
        )
        if hi != -neg_lo:
            raise DistributedError(
                f"{self.ranks.who()}: ranks are capturing different sizes lazily in the same call "
                f"(between {-neg_lo} and {hi}; mine is {size}): the batches did not agree. With "
                "agree='trust' every rank must pass the same batch size",
                rank=self.rank,
            )
        return not bad

    def stats(self) -> Any:
        """This rank's :meth:`GraphRunner.stats` (lazy captures agree across ranks)."""
        return self.runner.stats()

    def canary_stats(self) -> Any:
        """This rank's :meth:`GraphRunner.canary_stats` (a divergence counts on every rank)."""
        return self.runner.canary_stats()

    def __call__(self, *inputs: Any) -> Any:
        """One step on every rank: agree on the batch, replay the same graph everywhere.

        Returns this rank's ``n`` rows, as views valid until the next call (the
        :class:`GraphRunner` contract).
        """
        if self.agree == "trust":
            return self.runner(*inputs)
        problems = input_mismatches(inputs, self.runner.specs)
        n = 0 if problems else int(inputs[0].shape[self._lead_dim])
        lo, hi = self.agree_batch(n)
        if lo == hi:
            return self.runner(*inputs)
        if lo == 0 or self.on_mismatch == "raise":
            self._raise_mismatch(n, problems)
        return self._padded_call(inputs, n, hi)

    def _raise_mismatch(self, n: int, problems: list[str]) -> None:
        """Every rank reaches here together; gather the sizes and raise the same error."""
        raise self.ranks.batch_mismatch(n, problems, self._step)

    def _padded_call(self, inputs: Sequence[torch.Tensor], n: int, m: int) -> Any:
        """Run this rank's ``n`` rows as a batch of ``m`` (fill-valued padding rows)."""
        r = self.runner
        specs = r.specs
        if r.padded_size(m) is not None:
            # Zero-copy into the static buffers: no allocation on this path either.
            for x, view, s in zip(inputs, r.static_inputs(m), specs):
                view.narrow(s.batch_dim, 0, n).copy_(x)
                view.narrow(s.batch_dim, n, m - n).fill_(s.fill)
            rows: Sequence[torch.Tensor] = r.static_inputs(m)
            out = r.replay(m)
        else:
            rows = [
                torch.cat(
                    (x, torch.full(s.shape_at(m - n), s.fill, dtype=x.dtype, device=x.device)),
                    s.batch_dim,
                )
                for x, s in zip(inputs, specs)
            ]
            out = r(*rows)
        # The output layout says which dim of each output is the batch; written input
        # rows go back to the caller, as in runner(*inputs).
        return r.door.unpad(out, inputs, rows, n)

    # ------------------------------------------------------------ passthrough

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Sizes that have a graph (the same on every rank once capture returned)."""
        return self.runner.captured_sizes

    def padded_size(self, n: int) -> int | None:
        """The captured size a batch of ``n`` replays at (None: eager)."""
        return self.runner.padded_size(n)

    @property
    def specs(self) -> Any:
        """The input specs (shape apart from the batch dim, dtype, device, fill value)."""
        return self.runner.specs

    @property
    def state(self) -> Any:
        """The wrapped runner's declared state (``None`` when it declares none)."""
        return getattr(self.runner, "state", None)

    def eager(self, *inputs: Any) -> Any:
        """Run this rank's callable eagerly (its collectives run too: call on every rank)."""
        return self.runner.eager(*inputs)

    def verify(self, **kwargs: Any) -> Any:
        """:func:`graphguard.verify.verify` on every rank (each replay agrees its batch).

        Call it on every rank with the same arguments: both the replays and the eager
        forwards run the step's collectives.
        """
        return verify(self, **kwargs)

    def release(self) -> None:
        """Drop this rank's graphs (call on every rank; collectives inside are not run)."""
        self.runner.release()

    def recapture(self, *, reason: str) -> CaptureReport:
        """Drop the graphs, unlock the arenas on purpose and capture again, on every rank.

        Like :meth:`GraphRunner.recapture`; every rank must call it (it is a capture).
        """
        start_over(self.runner, reason)
        return self.capture()

    def update_weights(
        self,
        source: Any,
        *,
        on_moved: str = "raise",
        strict: bool = True,
        refresh: Callable[[], Any] | None = None,
    ) -> WeightUpdate:
        """Load this rank's shard in place on every rank; the ranks agree twice.

        Every rank must call it, with its own shard (a state dict of its module's names,
        a module, or a loader; see :meth:`GraphRunner.update_weights`). First each rank
        validates (and runs its loader); only when every rank's is valid does any rank
        copy, so a shard with a wrong shape leaves every rank's weights unchanged. Then
        each rank checks its addresses and the ranks agree before the next replay: a
        tensor moved on any rank is a :class:`~graphguard.errors.WeightsMovedError` on
        every rank (``on_moved="raise"``), or every rank recaptures every size
        (``"recapture"``: a partial ladder on some ranks would replay unmatched
        collectives). Errors name the ranks at fault. ``refresh``: as for
        :meth:`GraphRunner.update_weights` (derived tensors re-derived after the copy; an
        update that would leave ones the graphs read stale is refused on every rank).
        The same update sequence as every runner's (:func:`graphguard.weights.update_weights`),
        with this runner as the rank agreement.
        """

        with rank_logging(self.rank):
            return update_weights(
                [self.runner.door],
                source,
                on_moved=on_moved,
                strict=strict,
                refresh=refresh,
                agreement=self,
                recapture=self._recapture_every_size,
            )

    def refit(self, **kw: Any) -> Any:
        """``with r.refit(): load_my_shard(model)`` on every rank: each rank classifies
        what its own graphs read (:meth:`GraphRunner.refit`, same keywords), and the ranks
        agree on exit: a loader that failed on any rank, a weight left unwritten on any
        rank (``strict``) or moved on any rank raises on every rank, or every rank
        recaptures every size (``on_moved="recapture"``)."""
        from graphguard.weights.update import refit

        return refit([self.runner.door], agreement=self, recapture=self._recapture_every_size, **kw)

    def _recapture_every_size(self, door: Any, found: Any, reason: str) -> CaptureReport:
        """How a weight change recaptures under tensor parallelism: every size on every
        rank (a partial ladder on some ranks would replay unmatched collectives)."""
        report = self.recapture(reason=f"{reason}: every rank recaptures every size")
        report.recaptured_graphs = [(s, None) for s in report.captured]
        report.graphs_total = len(report.recaptured_graphs)
        return report

    def agree_update(self, stage: str, error: BaseException | None, *, fail: bool = True) -> bool:
        """Whether any rank has a problem with this weight update at ``stage`` (one CPU
        all-gather); with ``fail``, raise on every rank naming the ranks at fault."""
        return self.ranks.agree_update(stage, error, fail=fail)

    def audit(self) -> Any:
        """This rank's :meth:`GraphRunner.audit`: what its own graphs read (no collective:
        addresses are per rank, and check_weights verdicts agree through update_weights)."""
        return self.runner.audit()

    def check_weights(self) -> Any:
        """This rank's :meth:`GraphRunner.check_weights` (no collective: any rank may ask)."""
        return self.runner.check_weights()

    def log_report(self, out: Callable[[str], None] = print) -> None:
        """Print the capture report table, on rank 0 only (nothing in mode none)."""
        if self.report is not None and self.report.sizes and self.rank == self.group_ranks[0]:
            out(self.report.table())

    def __repr__(self) -> str:
        return (
            f"DistributedGraphRunner(rank {self.rank} of {self.group_ranks}, agree={self.agree}, "
            f"on_mismatch={self.on_mismatch}, {self.runner!r})"
        )


def _checked_options(
    agree: str, on_mismatch: str, options: CaptureOptions | None, kwargs: CaptureKwargs
) -> CaptureOptions:
    """The merged options, after refusing (before any collective) a process without
    torch.distributed, an unknown ``agree`` or ``on_mismatch``, and a capture error
    policy other than raising."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "DistributedGraphRunner needs torch.distributed initialized "
            "(dist.init_process_group, e.g. under torchrun); for one process use "
            "GraphRunner"
        )
    if agree not in AGREE_MODES:
        raise ConfigError(f"agree must be one of {AGREE_MODES}, got {agree!r}")
    if on_mismatch not in MISMATCH_POLICIES:
        raise ConfigError(f"on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
    opts = CaptureOptions.merge(options, where="DistributedGraphRunner", **kwargs)
    if opts.on_capture_error not in (None, "raise"):
        raise ConfigError(
            f"DistributedGraphRunner captures with on_capture_error='raise', got "
            f"{opts.on_capture_error!r}: a size skipped on one rank only would leave the "
            "ranks with different ladders, whose graphs replay collectives that never match"
        )
    return opts


def _rank_defaults(opts: CaptureOptions, fn: Callable[..., Any], first: bool) -> CaptureOptions:
    """This wrapper's defaults fill only what the caller left unset; the progress bar
    shows on the first rank only, whatever the caller asked for."""
    opts = opts.resolved(
        capture_error_mode="thread_local",
        on_capture_error="raise",
        name=getattr(fn, "__qualname__", None) or type(fn).__name__,
    )
    return dataclasses.replace(opts, progress=opts.progress is not False and first)


__all__ = [
    "AGREE_MODES",
    "MISMATCH_POLICIES",
    "BatchMismatchError",
    "CapturePlanMismatchError",
    "DistributedCaptureError",
    "DistributedError",
    "DistributedGraphRunner",
]
