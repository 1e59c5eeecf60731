"""What ranks must agree on: check-ins, barriers, capture plans, rank-tagged logs.

:class:`Ranks` is the CPU-side agreement half of
:class:`~graphguard.distributed.DistributedGraphRunner` (which holds one): every exchange
runs on the gloo control group with a timeout and turns a missing or failed peer into a
:class:`~graphguard.errors.DistributedError` naming the rank(s).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from graphguard.errors import (
    CapturePlanMismatchError,
    ConfigError,
    DistributedError,
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


def _ranks_in(text: str) -> list[int]:
    """The ranks a gloo ``monitored_barrier`` message names ("Ranks 1, 2 failed ...")."""
    import re

    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if not m:
        return []
    return [int(x) for x in re.findall(r"\d+", m.group(1))]


__all__ = ["Ranks", "control_group", "rank_logging", "seconds"]
