"""One engine step's batch: tokens, positions and slots, its rows, and its dispatch key.

Contract: :func:`make_batch` derives the :class:`~graphguard.dispatch.BatchKey` from the
rows and refuses (``ConfigError``) rows that do not tile the tokens exactly or tokens
that share a ``(slot, position)``, so the key always counts the inputs it travels with:
a key that disagreed with them would replay the wrong graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from graphguard.dispatch import BatchKey
from graphguard.errors import ConfigError

RowKind = Literal["prefill", "decode", "verify"]


@dataclass(frozen=True)
class Rows:
    """One request's run of rows in a step."""

    rid: int
    start: int
    length: int
    kind: RowKind
    drafts: tuple[int, ...] = ()


@dataclass
class StepBatch:
    """One step's inputs (``[T]`` int64 each, on the device), its key and row layout."""

    key: BatchKey
    token_ids: Tensor
    positions: Tensor
    slots: Tensor
    rows: list[Rows]

    @property
    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.token_ids, self.positions, self.slots

    @property
    def num_tokens(self) -> int:
        return self.key.num_tokens

    @property
    def label(self) -> str:
        """``decode`` (uniform q=1), ``verify`` (uniform q>1) or ``mixed``."""
        if not self.key.uniform:
            return "mixed"
        return "decode" if self.key.query_len == 1 else "verify"


def _row_problems(
    n: int, positions: Sequence[int], slots: Sequence[int], rows: list[Rows]
) -> list[str]:
    """Why ``rows`` do not describe ``n`` tokens exactly (empty when they do)."""
    problems: list[str] = []
    if not rows:
        return ["no rows"]
    start = 0
    for i, r in enumerate(rows):
        where = f"rows[{i}] (request {r.rid}, {r.kind})"
        if r.kind not in ("prefill", "decode", "verify"):
            problems.append(f"{where}: kind must be prefill, decode or verify")
        if r.start != start:
            problems.append(f"{where} starts at token {r.start}, expected {start} (rows must tile)")
        if r.length < 1:
            problems.append(f"{where} has length {r.length}, must be >= 1")
        if r.kind == "decode" and (r.length != 1 or r.drafts):
            problems.append(f"{where}: a decode row is 1 token without drafts, got {r.length}")
        if r.kind == "verify" and r.length != 1 + len(r.drafts):
            problems.append(
                f"{where}: a verify row is 1 + len(drafts) = {1 + len(r.drafts)} tokens, "
                f"got {r.length}"
            )
        if r.kind == "prefill" and r.drafts:
            problems.append(f"{where}: a prefill row has no drafts")
        start = max(start, r.start) + max(r.length, 0)
    if start != n:
        problems.append(f"the rows cover {start} tokens, the batch has {n}")
    rids = [r.rid for r in rows]
    if len(set(rids)) != len(rids):
        problems.append(f"a request appears in more than one row: {sorted(rids)}")
    pairs = set(zip(slots, positions))
    if len(pairs) != n:
        problems.append("two tokens share a (slot, position): their K/V would overwrite each other")
    if n and (min(slots) < 0 or min(positions) < 0):
        problems.append("slots and positions must be >= 0")
    return problems


def make_batch(
    tokens: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    rows: list[Rows],
    device: torch.device,
) -> StepBatch:
    """Build a :class:`StepBatch` with one host-to-device copy; the key follows the rows.

    Raises :class:`~graphguard.errors.ConfigError` unless the rows tile the tokens
    exactly (consecutive, each request once, decode rows 1 token, verify rows
    ``1 + len(drafts)``) and every token has its own ``(slot, position)``: a key that
    disagreed with the inputs would replay the wrong graph.
    """
    n = len(tokens)
    if not (n == len(positions) == len(slots)) or n == 0:
        raise ConfigError(
            f"make_batch: tokens, positions and slots need equal, non-zero lengths, got "
            f"{n}, {len(positions)}, {len(slots)}"
        )
    problems = _row_problems(n, positions, slots, rows)
    if problems:
        raise ConfigError("make_batch: the rows do not describe the tokens: " + "; ".join(problems))
    lengths = {r.length for r in rows}
    uniform = all(r.kind != "prefill" for r in rows) and len(lengths) == 1
    key = BatchKey.decode(len(rows), lengths.pop()) if uniform else BatchKey.mixed(n, len(rows))
    packed = torch.tensor([list(tokens), list(positions), list(slots)], dtype=torch.long)
    packed = packed.to(device)
    return StepBatch(key, packed[0], packed[1], packed[2], rows)


__all__ = ["RowKind", "Rows", "StepBatch", "make_batch"]
