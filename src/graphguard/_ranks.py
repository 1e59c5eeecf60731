"""What ranks must agree on: check-ins, barriers, capture plans, batch sizes, rank-tagged
logs.

:class:`Ranks` is the CPU-side agreement half of
:class:`~graphguard.distributed.DistributedGraphRunner` (which holds one): every exchange
runs on the gloo control group with a timeout and turns a missing or failed peer into a
:class:`~graphguard.errors.DistributedError` naming the rank(s).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from graphguard.errors import (
    BatchMismatchError,
    CapturePlanMismatchError,
    ConfigError,
    DistributedCaptureError,
    DistributedError,
    GraphCaptureError,
    StaleWeightsError,
    WeightsMovedError,
    first_line,
)

logger = logging.getLogger("graphguard")

_AFTER = {
    "validating": ". No rank copied a weight (a loader callable may have run)",
    "loading": ". The loaders ran on the other ranks: every rank's refit is refused",
    "verdict": ". The copies landed; the graphs still read weights the refit did not write",
}
"""What a failed weight-update stage left behind, per stage (:meth:`Ranks.agree_update`)."""


class _RankLogFilter(logging.Filter):
    """During this rank's capture: rank 0 keeps graphguard's INFO lines, other ranks keep
    warnings and errors only; every kept line is prefixed ``rank N:``.

    Only records emitted by the thread that runs the capture are touched: another
    thread's graphguard logging (a second runner, a server thread) passes unchanged.
    For those records the prefix is written into ``record.msg`` once (marked, so a
    record seen twice is not prefixed twice): the logger-level filter runs before any
    handler, so every handler sees the same prefixed line. A logger-level filter sees
    only records logged *on* its logger, never a child's (``graphguard.workspace``), so
    the rule that makes it see every line is that every graphguard module logs through
    ``logging.getLogger("graphguard")`` itself (``tests/test_process_state.py`` checks it).
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
def rank_logging(rank: int) -> Iterator[None]:
    filt = _RankLogFilter(rank)
    logger.addFilter(filt)
    try:
        yield
    finally:
        logger.removeFilter(filt)


def seconds(timeout: float | datetime.timedelta) -> datetime.timedelta:
    """``timeout`` as a timedelta (seconds when a number), refusing non-positive values."""
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ConfigError(f"timeout must be positive (seconds), got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


def control_group(
    group_ranks: list[int], timeout: datetime.timedelta, who: str
) -> dist.ProcessGroup:
    """A gloo group over the model group's ranks, for CPU-only agreement traffic."""
    if len(group_ranks) == dist.get_world_size():
        pg = dist.new_group(backend="gloo", timeout=timeout)
    else:
        pg = dist.new_group(
            ranks=group_ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
        )
    if pg is None:  # pragma: no cover - only for ranks outside the group
        raise ConfigError(f"{who} is not a member of the model's group")
    return cast(dist.ProcessGroup, pg)


class Ranks:
    """The agreement steps of one rank (the CPU-side half of
    :class:`~graphguard.distributed.DistributedGraphRunner`), each on the gloo control
    group with a timeout, each turning a missing or failed peer into a
    :class:`~graphguard.errors.DistributedError` naming the rank(s)."""

    def __init__(
        self,
        rank: int,
        group_ranks: list[int],
        group: dist.ProcessGroup | None,
        control: dist.ProcessGroup,
        timeout: datetime.timedelta,
    ) -> None:
        self.rank = rank
        self.group_ranks = group_ranks
        self.world_size = len(group_ranks)
        self.group = group
        self.control = control
        self.timeout = timeout
        self.peer_failures: dict[int, tuple[int, str]] = {}
        """Failures peers reported at the last check-in (rank -> (size, message))."""

    def who(self) -> str:
        return f"rank {self.rank}"

    def checkin(self, status: tuple[Any, ...], what: str) -> list[tuple[Any, ...]]:
        """All-gather every rank's status; raise naming the ranks that reported a failure.

        A plain ``("ok", ...)`` check-in (one per captured size) costs one gloo
        all-reduce of a flag; only when some rank has more to say (a failure, the final
        ladder) do all ranks pickle and all-gather their statuses. Every rank takes the
        same branch, since the flag's maximum decides.
        """
        gathered: list[Any] = [None] * self.world_size
        try:
            flag = torch.tensor([0 if status[0] == "ok" else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
            if int(flag[0]) == 0:
                return [status] * self.world_size
            dist.all_gather_object(gathered, status, group=self.control)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: check-in {what} failed: a peer did not arrive within "
                f"{self.timeout.total_seconds():g} s or left ({first_line(exc)})",
                rank=self.rank,
            ) from exc
        if status[0] != "failed":
            failed = {
                self.group_ranks[i]: (int(s[1]), str(s[2]))
                for i, s in enumerate(gathered)
                if s[0] == "failed"
            }
            if failed:
                self.peer_failures = failed
                raise DistributedError(
                    f"{self.who()}: stopping capture {what}: rank(s) {sorted(failed)} failed "
                    + "; ".join(f"rank {r} at size {sz}: {m}" for r, (sz, m) in failed.items()),
                    rank=self.rank,
                    ranks=sorted(failed),
                )
        return gathered

    def agree_update(self, what: str, mine: BaseException | None, *, fail: bool = True) -> bool:
        """All-gather each rank's problem with a weight update (one line, or None); with
        ``fail``, raise on every rank naming the ranks that have one. Returns whether any
        rank has one."""
        gathered: list[Any] = [None] * self.world_size
        # The whole message on one line: an update error lists every problem.
        line = f"{type(mine).__name__}: {' '.join(str(mine).split())[:800]}" if mine else None
        try:
            dist.all_gather_object(gathered, line, group=self.control)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: update_weights ({what}): a peer did not arrive within "
                f"{self.timeout.total_seconds():g} s or left ({first_line(exc)}); every rank "
                "must call update_weights",
                rank=self.rank,
            ) from exc
        bad = {self.group_ranks[i]: g for i, g in enumerate(gathered) if g is not None}
        if bad and fail:
            text = (
                f"{self.who()}: update_weights ({what}) failed on rank(s) {sorted(bad)}: "
                + "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
                + _AFTER.get(what, ". The copies landed; the graphs still read the moved tensors")
            )
            if isinstance(mine, StaleWeightsError):
                raise StaleWeightsError(text, names=mine.names) from mine
            if isinstance(mine, WeightsMovedError):
                raise WeightsMovedError(text, names=mine.names) from mine
            raise DistributedError(text, rank=self.rank, ranks=sorted(bad)) from mine
        return bool(bad)

    def barrier(self, what: str) -> None:
        """``monitored_barrier``: rank 0 names every rank that did not arrive in time."""
        try:
            dist.monitored_barrier(group=self.control, timeout=self.timeout, wait_all_ranks=True)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: barrier {what} failed after "
                f"{self.timeout.total_seconds():g} s: {first_line(exc)}. Every rank must "
                "call capture(); rank 0's error names the ranks that did not arrive",
                rank=self.rank,
                ranks=_ranks_in(str(exc)),
            ) from exc

    def verify_plans(self, mine: dict[str, Any]) -> None:
        """Every rank's capture signature ``mine`` equal, or a
        :class:`~graphguard.errors.CapturePlanMismatchError` naming the ranks and fields."""
        plans: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(plans, mine, group=self.control)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: exchanging capture plans failed: {first_line(exc)}",
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
            f"{self.who()}: ranks would capture different graphs (every rank must capture "
            f"the same ladder in the same order); rank(s) {bad} differ from rank {ref_rank} "
            f"in {', '.join(fields)}:\n  " + "\n  ".join(lines) + "\nNothing was captured.",
            rank=self.rank,
            ranks=bad,
            plans=by_rank,
        )

    def warm_communicator(self, device: torch.device) -> None:
        """One eager collective on the model group: NCCL creates its communicator lazily,
        and creating it inside a capture fails."""
        backend = str(dist.get_backend(self.group))
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
                f"{self.who()}: the warm-up collective on the model's group failed: "
                f"{first_line(exc)}",
                rank=self.rank,
            ) from exc

    def max_all_reduce(self, buf: torch.Tensor, what: str) -> list[int]:
        """``buf`` all-reduced with MAX on the control group, as ints; a peer that does not
        arrive within the timeout (or left) is a :class:`DistributedError` saying ``what``."""
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.control)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: agreeing on {what} failed: a peer did not arrive within "
                f"{self.timeout.total_seconds():g} s or left ({first_line(exc)})",
                rank=self.rank,
            ) from exc
        return [int(v) for v in buf.tolist()]

    def capture_failure(self, exc: BaseException) -> DistributedCaptureError:
        """The error every rank raises after a failed capture, naming the rank(s) at fault:
        this rank's failure told to the peers at their next check-in, unless they told
        theirs first (or the failure is the agreement's own)."""
        failures = dict(self.peer_failures)
        if not failures:
            size = exc.size if isinstance(exc, GraphCaptureError) else -1
            mine = (size, first_line(exc))
            failures[self.rank] = mine
            if not isinstance(exc, DistributedError) and not isinstance(
                getattr(exc, "cause", None), DistributedError
            ):
                # Our peers are at their next check-in (or the final one); meet them there.
                with contextlib.suppress(DistributedError):
                    statuses = self.checkin(("failed", *mine), "reporting a failed capture")
                    for i, s in enumerate(statuses):
                        if s[0] == "failed":
                            failures[self.group_ranks[i]] = (int(s[1]), str(s[2]))
        detail = "; ".join(
            f"rank {r} at size {sz}: {msg}" if sz >= 0 else f"rank {r}: {msg}"
            for r, (sz, msg) in sorted(failures.items())
        )
        return DistributedCaptureError(
            f"{self.who()}: capture failed on rank(s) {sorted(failures)}: {detail}. Graphs "
            "released on every rank (a ladder on some ranks only would replay unmatched "
            "collectives)",
            rank=self.rank,
            failures=failures,
            cause=exc,
        )

    def ladder_mismatch(self, statuses: list[tuple[Any, ...]]) -> DistributedError | None:
        """The ranks' final check-in ``("done", ladder)``: an error when the ladders differ."""
        ladders = {self.group_ranks[i]: s[1] for i, s in enumerate(statuses)}
        if len({tuple(v) for v in ladders.values()}) <= 1:
            return None
        return DistributedError(
            f"{self.who()}: ranks captured different ladders "
            + "; ".join(f"rank {r}: {v}" for r, v in sorted(ladders.items()))
            + ". Graphs released on every rank; their collectives would not match",
            rank=self.rank,
            ranks=sorted(ladders),
        )

    def batch_mismatch(self, n: int, problems: list[str], step: int) -> DistributedError:
        """Every rank reaches here together when the batches of ``step`` differ: gather
        the sizes (``n``: 0 where the inputs did not match the specs, ``problems`` says
        how) and return the same error on every rank."""
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, n, group=self.control)
        except Exception as exc:
            raise DistributedError(
                f"{self.who()}: ranks disagree on step {step} and gathering their "
                f"batch sizes failed: {first_line(exc)}",
                rank=self.rank,
            ) from exc
        sizes = {self.group_ranks[i]: int(v) for i, v in enumerate(gathered)}
        listing = ", ".join(f"rank {r}: {v}" for r, v in sorted(sizes.items()))
        invalid = [r for r, v in sizes.items() if v == 0]
        if invalid:
            local = f" (mine: {'; '.join(problems)})" if problems else ""
            return DistributedError(
                f"{self.who()}: step {step}: rank(s) {invalid} were called with inputs "
                f"that do not match the captured specs{local}; no rank ran the step",
                rank=self.rank,
                ranks=invalid,
            )
        return BatchMismatchError(
            f"{self.who()}: step {step}: ranks were called with different batch sizes "
            f"({listing}). Under tensor parallelism every rank must see the same batch; "
            "no rank ran the step. Broadcast the batch from one rank, or build the runner "
            "with on_mismatch='pad' if ranks legitimately hold different requests",
            rank=self.rank,
            sizes=sizes,
        )


def capture_plan(r: Any) -> dict[str, Any]:
    """What every rank must agree on before capturing, of runner ``r``: sizes in capture
    order (largest first), mode, warmup count, error mode, the lazy settings, and each
    input's dtype, batch dim and trailing shape; ``hash`` digests all of it."""
    plan: dict[str, Any] = {
        "sizes": sorted(r.sizes, reverse=True),
        "mode": r.mode.value,
        "warmup_iters": r.options.warmup_iters,
        "capture_error_mode": r.options.capture_error_mode,
        "lazy": r.lazy,
        "capture_now": sorted(r.options.lazy.capture_now if r.options.lazy else ()),
        "lazy_budget": r.options.lazy.budget if r.options.lazy else None,
        # The stage runs a forward (and its collectives) at every size with it.
        "lazy_warm_shapes": bool(r.options.lazy and r.options.lazy.warm_shapes),
        # Every rank must release the same graphs to make room.
        "lazy_evict": r.options.lazy.evict if r.options.lazy else None,
        "inputs": [(s.name, str(s.dtype), s.batch_dim, list(s.shape), s.fill) for s in r.specs],
    }
    plan["hash"] = hashlib.sha1(repr(sorted(plan.items())).encode()).hexdigest()[:12]
    return plan


def _ranks_in(text: str) -> list[int]:
    """The ranks a gloo ``monitored_barrier`` message names ("Ranks 1, 2 failed ...")."""
    import re

    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if not m:
        return []
    return [int(x) for x in re.findall(r"\d+", m.group(1))]


__all__ = ["Ranks", "capture_plan", "control_group", "rank_logging", "seconds"]
