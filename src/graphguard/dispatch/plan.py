"""The dispatch policy: for every batch key, FULL, PIECEWISE or eager, and why.

A :class:`DispatchPlan` resolves a key at call time: the key's class (uniform decode of
``query_len`` tokens per request, or anything else) gives an ordered list of routes, each
one captured-size table; the first table that holds the batch decides, by one
:meth:`~graphguard.sizes.PaddingTable.padded` lookup, and returns a decision made once per
captured size. No per-token table, so ``max_tokens`` costs nothing. The report rows are
built from the sizes, and every *downgrade* (not the best the mode offers) is listed
before anything is captured and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from graphguard.config import Mode
from graphguard.dispatch.keys import BatchKey, Decision, PlanRow
from graphguard.errors import ConfigError
from graphguard.sizes import PaddingTable, _is_int, capture_sizes, validate_sizes

logger = logging.getLogger("graphguard")

MAX_SIZE = 1 << 22
"""The largest capture size (tokens): a padding table holds one entry per token up to the
largest size, and each size is one captured graph; a size beyond this is a typo."""

Route = tuple[Callable[[int], "int | None"], dict[int, Decision]]


def _check_sizes(
    what: str, sizes: Sequence[int] | None, max_tokens: int, q: int
) -> tuple[int, ...]:
    hint = "graphguard.capture_sizes({}" + (f", multiple_of={q})" if q > 1 else ")")
    if sizes is None:
        if max_tokens > MAX_SIZE:
            raise ConfigError(
                f"DispatchPlan: the default {what} run up to max_tokens={max_tokens}, above the "
                f"largest capture size {MAX_SIZE} (one graph per size, one padding-table entry "
                f"per token). Pass {what}= (e.g. {hint.format(8192)}; larger batches then run "
                "eagerly) or "
                "lower max_tokens to the largest batch the engine schedules"
            )
        sizes = capture_sizes(max_tokens, multiple_of=q)
    out = validate_sizes(sizes, what=what)
    problems = []
    if out[-1] > max_tokens:
        problems.append(
            f"{[s for s in out if s > max_tokens][:10]} are above max_tokens={max_tokens}"
        )
    if out[-1] > MAX_SIZE:
        problems.append(f"{out[-1]} is above the largest capture size {MAX_SIZE}")
    odd = [s for s in out if s % q]
    if odd:
        problems.append(
            f"{odd[:10]} are not multiples of query_len={q} (a uniform batch of {q}-token "
            "requests never has that many tokens)"
        )
    if problems:
        raise ConfigError(
            f"{what}: "
            + "; ".join(problems)
            + f". Use e.g. {hint.format(min(max_tokens, MAX_SIZE))}."
        )
    return out


def _fmt_sizes(sizes: Sequence[int]) -> str:
    if len(sizes) <= 6:
        return ",".join(map(str, sizes)) or "-"
    return f"{sizes[0]},{sizes[1]},..,{sizes[-1]} ({len(sizes)})"


class DispatchPlan:
    """The resolved policy: for every batch key, FULL, PIECEWISE or eager, and why.

    Args:
        mode: :class:`~graphguard.config.Mode` or its name.
        max_tokens: the largest batch (tokens) the engine schedules; larger batches run
            eagerly. It also ends the default ladders.
        full_sizes: token counts with a FULL graph (uniform batches). Default
            ``capture_sizes(max_tokens, multiple_of=query_len)``; multiples of
            ``query_len``, since a uniform batch of ``q``-token requests has no other size.
        piecewise_sizes: token counts with piecewise graphs. Default
            ``capture_sizes(max_tokens)``.
        query_len: tokens per request of the uniform batches the FULL graphs serve
            (1 for decode, ``1 + k`` with ``k`` speculative tokens).
        full_mixed: mode FULL only: mixed batches may replay the FULL graphs (the
            callable's attention handles ragged batches); otherwise they run eagerly.
        name: shown in logs.

    :meth:`resolve` allocates and logs nothing for a batch that replays a graph.
    """

    def __init__(
        self,
        mode: Mode | str,
        *,
        max_tokens: int,
        full_sizes: Sequence[int] | None = None,
        piecewise_sizes: Sequence[int] | None = None,
        query_len: int = 1,
        full_mixed: bool = False,
        name: str = "dispatch",
    ) -> None:
        self.mode = m = Mode.parse(mode)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ConfigError(
                "DispatchPlan: max_tokens must be a positive int (the largest batch, in tokens, "
                f"the engine schedules), got {max_tokens!r}"
            )
        if not _is_int(query_len) or query_len < 1:
            raise ConfigError(
                "DispatchPlan: query_len must be a positive int (1 for decode, 1 + k with k "
                f"speculative tokens), got {query_len!r}"
            )
        if max_tokens < query_len:
            raise ConfigError(
                f"DispatchPlan: max_tokens={max_tokens} is below query_len={query_len}: no uniform "
                f"batch of {query_len}-token requests fits. Raise max_tokens (e.g. max_batch * "
                f"{query_len} + a prefill chunk) or lower query_len"
            )
        for arg, value in (("full_mixed", full_mixed), ("name", name)):
            if not isinstance(value, bool if arg == "full_mixed" else str):
                want = "True or False" if arg == "full_mixed" else "a string"
                raise ConfigError(f"DispatchPlan: {arg} must be {want}, got {value!r}")
        self.name, self.max_tokens, self.query_len = name, max_tokens, query_len
        q = query_len
        self.full_mixed = full_mixed and m is Mode.FULL
        self.notes: list[str] = []
        self.full_sizes: tuple[int, ...] = ()
        self.piecewise_sizes: tuple[int, ...] = ()
        if m.has_full:
            self.full_sizes = _check_sizes("full_sizes", full_sizes, max_tokens, q)
            if q > 1:
                self.notes.append(
                    f"spec decode q={q}: FULL sizes are multiples of {q} ({q} tokens per request)"
                )
        elif full_sizes:
            self.notes.append(f"mode {m.name}: full_sizes ignored (no FULL graphs)")
        if m.has_piecewise:
            self.piecewise_sizes = _check_sizes("piecewise_sizes", piecewise_sizes, max_tokens, 1)
        elif piecewise_sizes:
            self.notes.append(f"mode {m.name}: piecewise_sizes ignored (no piecewise graphs)")
        if full_mixed and m is not Mode.FULL:
            self.notes.append(f"mode {m.name}: full_mixed ignored (it only applies to mode FULL)")
        if m.has_full and q > 1:
            self.notes.append(
                f"uniform batches with a query length other than {q} are relaxed to "
                "tokens-only keys: " + ("piecewise graphs" if m.has_piecewise else "eager")
            )
        self._logged: set[str] = set()
        # Indexed by the key's class, ``uniform`` (a bool): [False] mixed, [True] uniform.
        self._specs = (self._route_specs(False), self._route_specs(True))
        self._routes = tuple([self._route(*r, u) for r in self._specs[u][0]] for u in (False, True))
        self.rows = self._rows(True) + self._rows(False)
        for row in self.downgrades():
            self._log_once(f"{row.keys}: {row.reason}", row)

    # ------------------------------------------------------------------ resolution

    def _route_specs(self, uniform: bool) -> tuple[list[tuple[Mode, PaddingTable, str]], str]:
        """The routes of one key class in fallback order, and why the rest runs eagerly."""
        m, q = self.mode, self.query_len
        full, pw = PaddingTable(self.full_sizes), PaddingTable(self.piecewise_sizes)
        big_f = f"num_tokens > largest FULL size {full.max_size}"
        big_p = f"num_tokens > largest piecewise size {pw.max_size}"
        if m is Mode.NONE:
            return [], "mode NONE: every batch runs eagerly"
        if uniform and m.has_full:
            routes = [(Mode.FULL, full, f"uniform decode q={q}: FULL graph")]
            if not m.has_piecewise:
                return routes, f"{big_f}: eager"
            routes.append((Mode.PIECEWISE, pw, f"{big_f}: piecewise graphs"))
            return routes, f"{big_f} and > largest piecewise size {pw.max_size}: eager"
        if m.has_piecewise:
            why = "mode PIECEWISE: uniform decode keys use" if uniform else "mixed batch:"
            return [(Mode.PIECEWISE, pw, f"{why} piecewise graphs")], f"{big_p}: eager"
        if self.full_mixed:
            why = "mode FULL with full_mixed: mixed batches replay FULL graphs"
            return [(Mode.FULL, full, why)], f"{big_f}: eager"
        return [], (
            "mode FULL: mixed batches run eagerly (FULL graphs serve uniform decode batches; "
            "use FULL_AND_PIECEWISE, or full_mixed=True if the callable handles ragged batches)"
        )

    def _route(self, kind: Mode, table: PaddingTable, reason: str, uniform: bool) -> Route:
        q = self.query_len
        keys: Callable[[int], BatchKey] = (
            (lambda s: BatchKey.decode(s // q, q)) if uniform and kind is Mode.FULL else BatchKey
        )
        return table.padded, {s: Decision(kind, keys(s), reason) for s in table.sizes}

    def resolve(self, key: BatchKey) -> Decision:
        """The decision for ``key``: one padding-table lookup per route tried.

        A uniform key with another query length than the FULL graphs' is relaxed to
        tokens-only, and a batch above ``max_tokens`` runs eagerly; each cause is logged once.
        """
        if not isinstance(key, BatchKey):
            raise ConfigError(
                f"{self.name}: a batch key must be a graphguard.BatchKey, got "
                f"{type(key).__name__} {key!r:.60}; build it from the batch: "
                "BatchKey.decode(num_reqs, query_len) for uniform decode, "
                "BatchKey.mixed(num_tokens, num_reqs) otherwise (call dispatcher(key, *inputs))"
            )
        n, uniform = key.num_tokens, key.uniform
        if uniform and key.query_len != self.query_len:
            if self.mode.has_full:
                return self._relaxed(key)
            uniform = False
        if n > self.max_tokens:
            return self._above(key)
        for padded, decisions in self._routes[uniform]:
            p = padded(n)
            if p is not None:
                return decisions[p]
        return Decision(Mode.NONE, BatchKey(n), self._specs[uniform][1])

    def _relaxed(self, key: BatchKey) -> Decision:
        inner = self.resolve(BatchKey(key.num_tokens))
        reason = (
            f"uniform decode q={key.query_len} but FULL graphs serve q={self.query_len}: "
            f"relaxed to tokens-only, {inner.reason}"
        )
        self._log_once(f"query_len {key.query_len}", reason)
        return Decision(inner.kind, inner.padded_key, reason)

    def _above(self, key: BatchKey) -> Decision:
        if self.mode is Mode.NONE:
            return Decision(
                Mode.NONE, BatchKey(key.num_tokens), "mode NONE: every batch runs eagerly"
            )
        reason = f"num_tokens {key.num_tokens} > max_tokens {self.max_tokens}: eager"
        self._log_once("above max_tokens", reason)
        return Decision(Mode.NONE, BatchKey(key.num_tokens), reason)

    def _log_once(self, cause: str, detail: PlanRow | str) -> None:
        if cause in self._logged:
            return
        self._logged.add(cause)
        if isinstance(detail, PlanRow):
            detail = (
                f"{detail.keys} num_tokens {detail.first}..{detail.last} run "
                f"{detail.kind.upper()} ({detail.reason})"
            )
        logger.info("%s: %s; logged once", self.name, detail)

    # ---------------------------------------------------------------------- report

    def _rows(self, uniform: bool) -> list[PlanRow]:
        """One row per route that holds some batch of the class, then the eager rest.

        Built from the sizes: a route covers the keys above the previous route's largest
        size up to its own. Anything short of FULL for uniform decode, or of PIECEWISE for
        mixed batches when the mode has it, is a downgrade (mode NONE asked for eager).
        """
        step = self.query_len if uniform else 1
        label = f"uniform decode q={step}" if uniform else "mixed"
        best = Mode.FULL if uniform or not self.mode.has_piecewise else Mode.PIECEWISE
        routes, eager = self._specs[uniform]
        rows: list[PlanRow] = []
        covered = 0

        def add(kind: Mode, last: int, table: PaddingTable, reason: str) -> None:
            first = (covered // step + 1) * step
            if first <= last:
                top = table.padded(last) or 0
                sizes = tuple(s for s in table.sizes if first <= s <= top)
                downgrade = kind != best and self.mode is not Mode.NONE
                rows.append(PlanRow(label, first, last, step, kind, sizes, reason, downgrade))

        for kind, table, reason in routes:
            add(kind, table.max_size // step * step, table, reason)
            covered = max(covered, table.max_size)
        add(Mode.NONE, self.max_tokens // step * step, PaddingTable(()), eager)
        return rows

    def downgrades(self) -> list[PlanRow]:
        """Rows where what runs is not the best the mode offers."""
        return [r for r in self.rows if r.downgrade]

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (JSON): sizes, one entry per row, notes."""
        return {
            "name": self.name,
            "mode": self.mode.value,
            "max_tokens": self.max_tokens,
            "query_len": self.query_len,
            "full_mixed": self.full_mixed,
            "full_sizes": list(self.full_sizes),
            "piecewise_sizes": list(self.piecewise_sizes),
            "rows": [r.to_dict() for r in self.rows],
            "beyond": f"num_tokens > {self.max_tokens} (max_tokens): eager",
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """A fixed-width report: one row per key class and token range; ``*`` marks downgrades."""
        q = f", query_len {self.query_len}" if self.query_len > 1 else ""
        lines = [
            f"dispatch plan {self.name!r}: mode {self.mode.value}, max_tokens {self.max_tokens}{q}",
            f"  {'keys':<20} {'num_tokens':>14}  {'kind':<9}  {'graphs (tokens)':<24} reason",
        ]
        for r in self.rows:
            rng = f"{r.first}..{r.last}" if r.first != r.last else str(r.first)
            rng += f"/{r.step}" if r.step > 1 and r.first != r.last else ""
            lines.append(
                f"{'*' if r.downgrade else ' '} {r.keys:<20} {rng:>14}  {r.kind.upper():<9}  "
                f"{_fmt_sizes(r.sizes):<24} {r.reason}"
            )
        lines.append(
            f"  {'any':<20} {'>' + str(self.max_tokens):>14}  {'EAGER':<9}  {'-':<24} "
            "above max_tokens"
        )
        lines += [f"  note: {note}" for note in self.notes]
        if self.downgrades():
            lines.append("  * downgrade: not the best the mode offers (logged once)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def with_sizes(
        self, *, full: Sequence[int] | None = None, piecewise: Sequence[int] | None = None
    ) -> DispatchPlan:
        """The same policy over other sizes (e.g. those that captured; None keeps a kind's).

        A kind left with no sizes degrades the mode (FULL_AND_PIECEWISE without FULL
        graphs is PIECEWISE), noted first in the new plan and logged as a warning.
        """
        full = tuple(self.full_sizes if full is None else full) if self.mode.has_full else None
        pw = self.piecewise_sizes if piecewise is None else piecewise
        pw = tuple(pw) if self.mode.has_piecewise else None
        mode, note = _degraded(self.mode, full == (), pw == ())
        if note:
            logger.warning("%s: %s; running as mode %s", self.name, note, mode.name)
        plan = DispatchPlan(
            mode,
            max_tokens=self.max_tokens,
            full_sizes=full if mode.has_full else None,
            piecewise_sizes=pw if mode.has_piecewise else None,
            query_len=self.query_len,
            full_mixed=self.full_mixed,
            name=self.name,
        )
        plan.notes[:0] = [note] if note else []
        return plan


def _degraded(mode: Mode, no_full: bool, no_piecewise: bool) -> tuple[Mode, str]:
    """The mode left when a kind captured nothing (every size failed), and the note why."""
    if not (no_full or no_piecewise):
        return mode, ""
    keep_full = mode.has_full and not no_full
    keep_pw = mode.has_piecewise and not no_piecewise
    left = Mode.FULL if keep_full else Mode.PIECEWISE if keep_pw else Mode.NONE
    gone = " and ".join(k for k, e in (("FULL", no_full), ("PIECEWISE", no_piecewise)) if e)
    return left, f"requested mode {mode.name}, but nothing captured for {gone}"
