"""Graphs with collectives inside: capture and replay across tensor-parallel ranks.

A tensor-parallel decode step all-reduces partial results (NCCL through
``torch.distributed``), so its CUDA graphs contain collectives, and a collective only
completes when *every* rank of the group launches the matching one. Two things that
are harmless on one GPU become hangs with no message across ranks:

* **different ladders or a different capture order**: rank 0 warms up size 8 (an eager
  all-reduce of ``[8, d]``) while rank 1 warms up size 16; both wait forever.
* **different graphs at replay**: rank 0 gets 5 rows and replays the size-8 graph, rank 1
  gets 9 and replays size 16; the NCCL kernels of the two graphs never match.

:class:`DistributedGraphRunner` wraps a :class:`~graphguard.runner.GraphRunner`
(composition: the single-GPU lifecycle is unchanged) and adds what the ranks must agree
on, each check answered by an error that names the rank(s) instead of a hang:

1. **Before capture** (every rank calls :meth:`DistributedGraphRunner.capture`):
   a ``monitored_barrier`` (a rank that does not arrive within ``timeout`` is named),
   an all-gather of every rank's capture plan (ladder in capture order, mode, input
   specs; a mismatch is a :class:`CapturePlanMismatchError` listing each rank's sizes),
   one eager collective on the model's group so the NCCL communicator exists *before*
   any capture (creating it inside a capture fails), a device synchronize, a barrier.
2. **During capture**: every rank captures the same ladder, largest first. Before the
   warmup of each size the ranks check in (a CPU all-gather): a rank whose capture
   failed reports it at the next check-in instead of leaving its peers blocked in the
   next size's warmup collective, and every rank raises
   :class:`DistributedCaptureError` naming the failed rank(s) and size.
3. **At each call** (``agree="allreduce"``): one all-reduce (MAX) of ``[n, -n]`` gives
   every rank the largest and smallest batch of the step. Equal -> every rank replays
   the same padded graph (same ladder, verified). Different -> ``on_mismatch``:
   ``"raise"`` (default) raises :class:`BatchMismatchError` on every rank naming each
   rank's batch; ``"pad"`` pads every rank to the largest batch (fill values) and
   replays that graph, returning this rank's ``n`` rows.

Why ``on_mismatch="raise"`` by default: under tensor parallelism every rank computes
the *same* rows, so ranks seeing different batch sizes means the scheduler diverged;
padding would all-reduce rows of different requests and return wrong logits silently.
``"pad"`` is for data/expert-parallel layouts (vLLM's DP padding) where ranks hold
different requests but their collectives must still have matching shapes.

**The cost of agreeing.** The all-reduce runs on a CPU tensor over a dedicated
``gloo`` group (made once at construction), not on a device tensor over NCCL: reading a
device all-reduce back (``.item()``) would wait for every kernel queued before it,
removing the CPU/GPU overlap that graphs exist to give; the gloo round-trip never
touches the device. It is still a host round-trip between processes on every step
(tens of microseconds on one host; ``bench/bench_tp.py`` measures it as
``agree_us``). ``agree="trust"`` skips it when the engine already guarantees identical
batches on every rank (e.g. its scheduler broadcasts each step's batch from rank 0);
if that guarantee is broken the ranks replay different graphs and the collectives hang
on the device, so use ``trust`` only with such a broadcast.

**Capture error mode** defaults to ``"thread_local"``: PyTorch's NCCL watchdog thread
polls the CUDA events of earlier collectives (``cudaEventQuery``), and in ``"global"``
mode a query from another thread while this one captures invalidates the capture
(pytorch/pytorch#104555; newer PyTorch makes the watchdog's queries thread-local itself,
torch 2.4-2.6 do not). ``"thread_local"`` still fails loudly on an unsafe call (a
synchronize, an allocation outside the pool) made by the capturing thread itself;
``"relaxed"`` would not, so it is not the default.

What stays a hang: a rank that raises in the *middle* of an eager forward that other
ranks are running (between two collectives of a warmup) leaves its peers inside a NCCL
collective until the process group's own timeout (``init_process_group(timeout=...)``);
on gloo that timeout raises and the ranks then report each other's failures. Keep the
process group timeout short while bringing a model up.

Progress bar and INFO logs of capture appear on rank 0 only; warnings and errors from
every rank are prefixed with ``rank N:``, and every error this module raises names the
rank that raises it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from graphguard import phase
from graphguard.buffers import input_mismatches
from graphguard.config import Mode
from graphguard.errors import (
    BatchMismatchError,
    CapturePlanMismatchError,
    ConfigError,
    DistributedCaptureError,
    DistributedError,
    GraphCaptureError,
)
from graphguard.phase import Phase
from graphguard.report import CaptureReport
from graphguard.runner import GraphRunner
from graphguard.verify import verify

logger = logging.getLogger("graphguard")

AGREE_MODES = ("allreduce", "trust")
MISMATCH_POLICIES = ("raise", "pad")


class _RankLogFilter(logging.Filter):
    """During this rank's capture: rank 0 keeps graphguard's INFO lines, other ranks keep
    warnings and errors only; every kept line is prefixed ``rank N:``.

    Only records emitted by the thread that runs the capture are touched: another
    thread's graphguard logging (a second runner, a server thread) passes unchanged.
    For those records the prefix is written into ``record.msg`` once (marked, so a
    record seen twice is not prefixed twice): the logger-level filter runs before any
    handler, so every handler sees the same prefixed line. A ``LoggerAdapter`` cannot
    do this, since graphguard's modules log through the plain ``graphguard`` logger.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        if self.rank != 0 and record.levelno < logging.WARNING:
            return False
        if not getattr(record, "_gg_rank_tagged", False):
            record.msg = f"rank {self.rank}: {record.msg}"
            record._gg_rank_tagged = True
        return True


@contextlib.contextmanager
def _rank_logging(rank: int) -> Iterator[None]:
    filt = _RankLogFilter(rank)
    logger.addFilter(filt)
    try:
        yield
    finally:
        logger.removeFilter(filt)


def _seconds(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ConfigError(f"timeout must be positive, got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


class DistributedGraphRunner:
    """A :class:`GraphRunner` whose ranks capture and replay the same graphs.

    Every rank of ``group`` must construct it (it creates a gloo control group, a
    collective) with the same ladder, call :meth:`capture`, and call it once per step.

    Args:
        fn, example_inputs: as for :class:`GraphRunner`; ``fn`` runs the rank's shard and
            its collectives (e.g. :class:`graphguard.models.tp.TensorParallelLlama`).
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
        progress: show the capture progress bar (on rank 0 only, whatever this says).
        capture_error_mode: default ``"thread_local"`` (see the module docstring).
        runner_kwargs: every other :class:`GraphRunner` argument (sizes, fill_values,
            before_capture, workspaces, ...). ``on_capture_error="skip"`` is refused:
            a size skipped on one rank only would leave the ladders different.
    """

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
        progress: bool = True,
        capture_error_mode: str = "thread_local",
        **runner_kwargs: Any,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "DistributedGraphRunner needs torch.distributed initialized "
                "(dist.init_process_group, e.g. under torchrun); for one process use "
                "GraphRunner"
            )
        if agree not in AGREE_MODES:
            raise ConfigError(f"agree must be one of {AGREE_MODES}, got {agree!r}")
        if on_mismatch not in MISMATCH_POLICIES:
            raise ConfigError(
                f"on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}"
            )
        if runner_kwargs.get("on_capture_error", "raise") != "raise":
            raise ConfigError(
                "DistributedGraphRunner captures with on_capture_error='raise': a size "
                "skipped on one rank only would leave the ranks with different ladders, "
                "whose graphs replay collectives that never match"
            )
        self.group = group
        self.rank = dist.get_rank()
        self.group_ranks: list[int] = list(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.world_size = len(self.group_ranks)
        self.timeout = _seconds(timeout)
        self.agree = agree
        self.on_mismatch = on_mismatch
        self.user_fn = fn
        self.control_group = control_group or self._make_control_group()
        name = runner_kwargs.pop("name", None) or getattr(fn, "__qualname__", None)
        self.runner = GraphRunner(
            self._fn,
            example_inputs,
            progress=progress and self.rank == self.group_ranks[0],
            capture_error_mode=capture_error_mode,
            on_capture_error="raise",
            name=name or type(fn).__name__,
            **runner_kwargs,
        )
        self.name = self.runner.name
        self._lead_dim = self.runner.specs[0].batch_dim
        # The agreement buffer: [n, -n] all-reduced with MAX gives (max, -min) at once.
        self._agree_buf = torch.zeros(2, dtype=torch.int64)
        self._step = 0
        self._capturing = False
        self._checked_in: set[int] = set()
        self._peer_failures: dict[int, tuple[int, str]] = {}
        self.report: CaptureReport | None = None

    # ----------------------------------------------------------------- groups

    def _make_control_group(self) -> dist.ProcessGroup:
        """A gloo group over the model group's ranks, for CPU-only agreement traffic."""
        world = dist.get_world_size()
        if self.world_size == world:
            pg = dist.new_group(backend="gloo", timeout=self.timeout)
        else:
            pg = dist.new_group(
                ranks=self.group_ranks,
                backend="gloo",
                timeout=self.timeout,
                use_local_synchronization=True,
            )
        if pg is None:  # pragma: no cover - only for ranks outside the group
            raise ConfigError(f"{self._who()} is not a member of the model's group")
        return cast(dist.ProcessGroup, pg)

    def _who(self) -> str:
        return f"rank {self.rank}"

    # ---------------------------------------------------------------- capture

    def plan(self) -> dict[str, Any]:
        """This rank's capture plan: what every rank must agree on before capturing.

        Sizes in capture order (largest first), mode, warmup count, error mode, and each
        input's dtype, batch dim and trailing shape; ``hash`` digests all of it.
        """
        r = self.runner
        plan: dict[str, Any] = {
            "sizes": sorted(r.sizes, reverse=True),
            "mode": r.mode.value,
            "warmup_iters": r.warmup_iters,
            "capture_error_mode": r.capture_error_mode,
            "inputs": [(s.name, str(s.dtype), s.batch_dim, list(s.shape), s.fill) for s in r.specs],
        }
        plan["hash"] = hashlib.sha1(repr(sorted(plan.items())).encode()).hexdigest()[:12]
        return plan

    def capture(self) -> CaptureReport:
        """Agree, synchronize, capture the same ladder on every rank, agree again.

        Every rank must call it. Returns this rank's report (printed by rank 0 only, see
        :meth:`log_report`). Raises :class:`CapturePlanMismatchError`,
        :class:`DistributedCaptureError` or :class:`DistributedError` on every rank,
        each naming the rank(s) at fault.
        """
        with _rank_logging(self.rank):
            self._barrier("before comparing capture plans")
            self._verify_plans()
            self._warm_communicator()
            self._synchronize()
            self._barrier("before capture")
            self._capturing = True
            self._checked_in.clear()
            self._peer_failures.clear()
            try:
                report = self.runner.capture()
                self._capturing = False
                statuses = self._checkin(("done", list(report.captured)), "after capture")
            except BaseException as exc:
                self._capturing = False
                self._after_failed_capture(exc)
                raise  # pragma: no cover - _after_failed_capture always raises
            ladders = {self.group_ranks[i]: s[1] for i, s in enumerate(statuses)}
            if len({tuple(v) for v in ladders.values()}) > 1:
                self.runner.release()
                raise DistributedError(
                    f"{self._who()}: ranks captured different ladders "
                    + "; ".join(f"rank {r}: {v}" for r, v in sorted(ladders.items()))
                    + ". Graphs released on every rank; their collectives would not match",
                    rank=self.rank,
                    ranks=sorted(ladders),
                )
            self.report = report
            if self.rank == self.group_ranks[0] and report.sizes:
                logger.info("%s: every rank captured %s", self.name, report.captured)
        return report

    def _after_failed_capture(self, exc: BaseException) -> None:
        """Tell the peers (unless they told us), release the graphs, raise naming ranks."""
        self.runner.release()
        failures = dict(self._peer_failures)
        if not failures:
            size = exc.size if isinstance(exc, GraphCaptureError) else -1
            mine = (size, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            failures[self.rank] = mine
            if not isinstance(exc, DistributedError) and not isinstance(
                getattr(exc, "cause", None), DistributedError
            ):
                # Our peers are at their next check-in (or the final one); meet them there.
                with contextlib.suppress(DistributedError):
                    statuses = self._checkin(("failed", *mine), "reporting a failed capture")
                    for i, s in enumerate(statuses):
                        if s[0] == "failed":
                            failures[self.group_ranks[i]] = (int(s[1]), str(s[2]))
        detail = "; ".join(
            f"rank {r} at size {sz}: {msg}" if sz >= 0 else f"rank {r}: {msg}"
            for r, (sz, msg) in sorted(failures.items())
        )
        raise DistributedCaptureError(
            f"{self._who()}: capture failed on rank(s) {sorted(failures)}: {detail}. Graphs "
            "released on every rank (a ladder on some ranks only would replay unmatched "
            "collectives)",
            rank=self.rank,
            failures=failures,
            cause=exc,
        ) from exc

    def _fn(self, *args: Any) -> Any:
        """The captured callable: a check-in before each size's first warmup, then ``fn``."""
        if self._capturing and phase.current_phase() is Phase.WARMUP:
            size = int(args[0].shape[self._lead_dim])
            if size not in self._checked_in:
                self._checked_in.add(size)
                self._checkin(("ok", size), f"before warming up size {size}")
        return self.user_fn(*args)

    def _checkin(self, status: tuple[Any, ...], what: str) -> list[tuple[Any, ...]]:
        """All-gather every rank's status; raise naming the ranks that reported a failure."""
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, status, group=self.control_group)
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: check-in {what} failed: a peer did not arrive within "
                f"{self.timeout.total_seconds():g} s or left ({_first_line(exc)})",
                rank=self.rank,
            ) from exc
        if status[0] != "failed":
            failed = {
                self.group_ranks[i]: (int(s[1]), str(s[2]))
                for i, s in enumerate(gathered)
                if s[0] == "failed"
            }
            if failed:
                self._peer_failures = failed
                raise DistributedError(
                    f"{self._who()}: stopping capture {what}: rank(s) {sorted(failed)} failed "
                    + "; ".join(f"rank {r} at size {sz}: {m}" for r, (sz, m) in failed.items()),
                    rank=self.rank,
                    ranks=sorted(failed),
                )
        return gathered

    def _barrier(self, what: str) -> None:
        """``monitored_barrier``: rank 0 names every rank that did not arrive in time."""
        try:
            dist.monitored_barrier(
                group=self.control_group, timeout=self.timeout, wait_all_ranks=True
            )
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: barrier {what} failed after "
                f"{self.timeout.total_seconds():g} s: {_first_line(exc)}. Every rank must "
                "call capture(); rank 0's error names the ranks that did not arrive",
                rank=self.rank,
                ranks=_ranks_in(str(exc)),
            ) from exc

    def _verify_plans(self) -> None:
        mine = self.plan()
        plans: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(plans, mine, group=self.control_group)
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: exchanging capture plans failed: {_first_line(exc)}",
                rank=self.rank,
            ) from exc
        by_rank = {self.group_ranks[i]: p for i, p in enumerate(plans)}
        ref_rank = self.group_ranks[0]
        ref = by_rank[ref_rank]
        bad = [r for r, p in by_rank.items() if p["hash"] != ref["hash"]]
        if not bad:
            return
        fields = sorted(
            {k for r in bad for k in ref if k != "hash" and by_rank[r].get(k) != ref.get(k)}
        )
        lines = [
            f"rank {r}: sizes {p['sizes']} (mode {p['mode']}, plan {p['hash']})"
            for r, p in sorted(by_rank.items())
        ]
        raise CapturePlanMismatchError(
            f"{self._who()}: ranks would capture different graphs (every rank must capture "
            f"the same ladder in the same order); rank(s) {bad} differ from rank {ref_rank} "
            f"in {', '.join(fields)}:\n  " + "\n  ".join(lines) + "\nNothing was captured.",
            rank=self.rank,
            ranks=bad,
            plans=by_rank,
        )

    def _warm_communicator(self) -> None:
        """One eager collective on the model group: NCCL creates its communicator lazily,
        and creating it inside a capture fails."""
        backend = str(dist.get_backend(self.group))
        device = self.runner.specs[0].device
        if "nccl" in backend and device.type == "cuda":
            t = torch.zeros(1, device=device)
        elif "nccl" in backend:
            return
        else:
            t = torch.zeros(1)
        try:
            dist.all_reduce(t, group=self.group)
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: the warm-up collective on the model's group failed: "
                f"{_first_line(exc)}",
                rank=self.rank,
            ) from exc

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
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.control_group)
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: agreeing on the batch size of step {self._step} (mine: {n}) "
                f"failed: a peer did not arrive within {self.timeout.total_seconds():g} s or "
                f"left ({_first_line(exc)})",
                rank=self.rank,
            ) from exc
        hi, neg_lo = buf.tolist()
        return -int(neg_lo), int(hi)

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
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, n, group=self.control_group)
        except Exception as exc:
            raise DistributedError(
                f"{self._who()}: ranks disagree on step {self._step} and gathering their "
                f"batch sizes failed: {_first_line(exc)}",
                rank=self.rank,
            ) from exc
        sizes = {self.group_ranks[i]: int(v) for i, v in enumerate(gathered)}
        listing = ", ".join(f"rank {r}: {v}" for r, v in sorted(sizes.items()))
        invalid = [r for r, v in sizes.items() if v == 0]
        if invalid:
            local = f" (mine: {'; '.join(problems)})" if problems else ""
            raise DistributedError(
                f"{self._who()}: step {self._step}: rank(s) {invalid} were called with inputs "
                f"that do not match the captured specs{local}; no rank ran the step",
                rank=self.rank,
                ranks=invalid,
            )
        raise BatchMismatchError(
            f"{self._who()}: step {self._step}: ranks were called with different batch sizes "
            f"({listing}). Under tensor parallelism every rank must see the same batch; "
            "no rank ran the step. Broadcast the batch from one rank, or build the runner "
            "with on_mismatch='pad' if ranks legitimately hold different requests",
            rank=self.rank,
            sizes=sizes,
        )

    def _padded_call(self, inputs: Sequence[torch.Tensor], n: int, m: int) -> Any:
        """Run this rank's ``n`` rows as a batch of ``m`` (fill-valued padding rows)."""
        r = self.runner
        specs = r.specs
        if r.padded_size(m) is not None:
            # Zero-copy into the static buffers: no allocation on this path either.
            for x, view, s in zip(inputs, r.static_inputs(m), specs):
                view.narrow(s.batch_dim, 0, n).copy_(x)
                view.narrow(s.batch_dim, n, m - n).fill_(s.fill)
            out = r.replay(m)
        else:
            padded = [
                torch.cat(
                    (x, torch.full(s.shape_at(m - n), s.fill, dtype=x.dtype, device=x.device)),
                    s.batch_dim,
                )
                for x, s in zip(inputs, specs)
            ]
            out = r(*padded)
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.narrow(0, 0, n) if t.ndim > 0 and t.shape[0] == m else t,
            out,
        )

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

    def log_report(self, out: Callable[[str], None] = print) -> None:
        """Print the capture report table, on rank 0 only (nothing in mode none)."""
        if self.report is not None and self.report.sizes and self.rank == self.group_ranks[0]:
            out(self.report.table())

    def __repr__(self) -> str:
        return (
            f"DistributedGraphRunner(rank {self.rank} of {self.group_ranks}, agree={self.agree}, "
            f"on_mismatch={self.on_mismatch}, {self.runner!r})"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _ranks_in(text: str) -> list[int]:
    """The ranks a gloo ``monitored_barrier`` message names ("Ranks 1, 2 failed ...")."""
    import re

    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if not m:
        return []
    return [int(x) for x in re.findall(r"\d+", m.group(1))]


__all__ = [
    "AGREE_MODES",
    "MISMATCH_POLICIES",
    "BatchMismatchError",
    "CapturePlanMismatchError",
    "DistributedCaptureError",
    "DistributedError",
    "DistributedGraphRunner",
]
