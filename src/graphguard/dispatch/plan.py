"""The dispatch policy: for every batch key, FULL, PIECEWISE or eager, and why.

Resolved at call time: the key's class (uniform decode at the plan's ``query_len``, or
anything else) has routes in fallback order, each a padding table of captured sizes; the
first that holds the batch decides, with a decision made once per captured size. No table
per token, so ``max_tokens`` costs nothing; the report rows are built from the sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from graphguard.config import Mode
from graphguard.dispatch.keys import BatchKey, Decision, PlanRow
from graphguard.errors import ConfigError
from graphguard.sizes import MAX_SIZE, PaddingTable, capture_sizes, is_int, validate_sizes

logger = logging.getLogger("graphguard")


_Spec = tuple[Mode, PaddingTable, str]  # one route: its kind, its sizes, why
_Route = tuple[Callable[[int], "int | None"], dict[int, Decision]]  # lookup, then decision


def _check_sizes(
    what: str, sizes: Sequence[int] | None, max_tokens: int, q: int
) -> tuple[int, ...]:
    hint = "graphguard.capture_sizes({}" + (f", multiple_of={q})" if q > 1 else ")")
    if sizes is None and max_tokens > MAX_SIZE:
        raise ConfigError(
            f"DispatchPlan: the default {what} run up to max_tokens={max_tokens}, past the "
            f"largest capture size {MAX_SIZE} (one graph per size). Pass {what}= (e.g. "
            f"{hint.format(8192)}; larger batches run eagerly) or lower max_tokens"
        )
    out = validate_sizes(
        capture_sizes(max_tokens, multiple_of=q) if sizes is None else sizes, what=what
    )
    above, odd = [s for s in out if s > max_tokens], [s for s in out if s % q]
    bad = [f"{above[:10]} are above max_tokens={max_tokens}"] if above else []
    bad += [f"{out[-1]} is above the largest capture size {MAX_SIZE}"] if out[-1] > MAX_SIZE else []
    if odd:
        bad.append(
            f"{odd[:10]} are not multiples of query_len={q} (a uniform batch of {q}-token "
            "requests never has that many tokens)"
        )
    if bad:
        fix = hint.format(min(max_tokens, MAX_SIZE))
        raise ConfigError(f"{what}: " + "; ".join(bad) + f". Use e.g. {fix}.")
    return out


def _fmt_sizes(sizes: Sequence[int]) -> str:
    if len(sizes) <= 6:
        return ",".join(map(str, sizes)) or "-"
    return f"{sizes[0]},{sizes[1]},..,{sizes[-1]} ({len(sizes)})"


class DispatchPlan:
    """The policy: for every batch key, FULL, PIECEWISE or eager, and why.

    Args:
        mode: :class:`~graphguard.config.Mode` or its name.
        max_tokens: the largest batch (tokens) the engine schedules; larger ones run
            eagerly. It ends the default ladders.
        full_sizes: token counts with a FULL graph, for uniform batches; multiples of
            ``query_len`` (a uniform batch has no other size). Default
            ``capture_sizes(max_tokens, multiple_of=query_len)``.
        piecewise_sizes: token counts with piecewise graphs. Default
            ``capture_sizes(max_tokens)``.
        query_len: tokens per request of the uniform batches the FULL graphs serve
            (1 for decode, ``1 + k`` with ``k`` speculative tokens).
        full_mixed: mode FULL only: mixed batches replay the FULL graphs (the callable's
            attention handles ragged batches) instead of running eagerly.
        name: shown in logs.

    Every *downgrade* (not the best the mode offers) is a row of :meth:`table`, listed
    before capture and logged once. :meth:`resolve` allocates and logs nothing for a
    batch that replays a graph.
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
        q, bad = query_len, []
        if not is_int(max_tokens) or max_tokens < 1:
            bad.append(
                "max_tokens must be a positive int (the largest batch, in tokens, the engine "
                f"schedules), got {max_tokens!r:.60}"
            )
        if not is_int(q) or q < 1:
            bad.append(
                "query_len must be a positive int (1 for decode, 1 + k with k speculative "
                f"tokens), got {q!r:.60}"
            )
        elif not bad and max_tokens < q:
            bad.append(
                f"max_tokens={max_tokens} is below query_len={q}: no uniform batch of {q}-token "
                f"requests fits. Raise max_tokens (e.g. max_batch * {q} + a prefill chunk) or "
                "lower query_len"
            )
        if not isinstance(full_mixed, bool):
            bad.append(f"full_mixed must be True or False, got {full_mixed!r:.60}")
        if not isinstance(name, str):
            bad.append(f"name must be a string, got {name!r:.60}")
        if bad:
            raise ConfigError("DispatchPlan: " + "; ".join(bad))
        self.name, self.max_tokens, self.query_len = name, max_tokens, q
        self.full_mixed = full_mixed and m is Mode.FULL
        self.full_sizes: tuple[int, ...] = ()
        self.piecewise_sizes: tuple[int, ...] = ()
        self.notes: list[str] = []
        if m.has_full:
            self.full_sizes = _check_sizes("full_sizes", full_sizes, max_tokens, q)
        if m.has_piecewise:
            self.piecewise_sizes = _check_sizes("piecewise_sizes", piecewise_sizes, max_tokens, 1)
        for ignored, what, why in (
            (full_sizes and not m.has_full, "full_sizes", "no FULL graphs"),
            (piecewise_sizes and not m.has_piecewise, "piecewise_sizes", "no piecewise graphs"),
            (full_mixed and m is not Mode.FULL, "full_mixed", "it only applies to mode FULL"),
        ):
            self.notes += [f"mode {m.name}: {what} ignored ({why})"] if ignored else []
        if m.has_full and q > 1:
            self.notes.append(
                f"spec decode q={q}: FULL sizes are multiples of {q} ({q} tokens per request)"
            )
            then = "piecewise graphs" if m.has_piecewise else "eager"
            self.notes.append(
                f"uniform batches with a query length other than {q} are relaxed to "
                f"tokens-only keys: {then}"
            )
        self._logged: set[str] = set()
        full, pw = PaddingTable(self.full_sizes), PaddingTable(self.piecewise_sizes)
        # Indexed by the key class ``uniform``, a bool: [False] mixed, [True] uniform decode.
        self._specs = (self._route_specs(False, full, pw), self._route_specs(True, full, pw))
        self._routes = tuple([self._route(spec, u) for spec in self._specs[u][0]] for u in (0, 1))
        self.rows = self._rows(True) + self._rows(False)
        for row in self.downgrades():
            self._log_once(f"{row.keys}: {row.reason}", row)

    # ------------------------------------------------------------------ resolution

    def _route_specs(
        self, uniform: bool, full: PaddingTable, pw: PaddingTable
    ) -> tuple[list[_Spec], str]:
        """The routes of one key class in fallback order, and why the rest runs eagerly."""
        m = self.mode
        big_f = f"num_tokens > largest FULL size {full.max_size}"
        big_p = f"num_tokens > largest piecewise size {pw.max_size}"
        if m is Mode.NONE:
            return [], "mode NONE: every batch runs eagerly"
        if uniform and m.has_full:
            routes = [(Mode.FULL, full, f"uniform decode q={self.query_len}: FULL graph")]
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

    def _route(self, spec: _Spec, uniform: int) -> _Route:
        """A route's lookup and its decisions, one per captured size, made once here."""
        kind, table, why = spec
        q = self.query_len
        key: Callable[[int], BatchKey] = BatchKey
        if uniform and kind is Mode.FULL:
            key = lambda s: BatchKey.decode(s // q, q)  # noqa: E731
        return table.padded, {s: Decision(kind, key(s), why) for s in table.sizes}

    def resolve(self, key: BatchKey) -> Decision:
        """The decision for ``key``: one padding-table lookup per route tried.

        A uniform key at another query length than the FULL graphs' is relaxed to
        tokens-only, a batch above ``max_tokens`` runs eagerly; each cause logged once.
        """
        if not isinstance(key, BatchKey):
            raise ConfigError(
                f"{self.name}: a batch key must be a graphguard.BatchKey, got "
                f"{type(key).__name__} {key!r:.60}; build it from the batch with "
                "BatchKey.decode(num_reqs, query_len) for uniform decode or "
                "BatchKey.mixed(num_tokens, num_reqs), and call dispatcher(key, *inputs)"
            )
        n, uniform = key.num_tokens, key.uniform
        if uniform and key.query_len != self.query_len:
            if self.mode.has_full:
                return self._relaxed(key)
            uniform = False  # piecewise graphs do not care about the query length
        if n > self.max_tokens:
            return self._above(n)
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

    def _above(self, n: int) -> Decision:
        reason = self._specs[False][1]
        if self.mode is not Mode.NONE:
            reason = f"num_tokens {n} > max_tokens {self.max_tokens}: eager"
            self._log_once("above max_tokens", reason)
        return Decision(Mode.NONE, BatchKey(n), reason)

    def _log_once(self, cause: str, detail: PlanRow | str) -> None:
        if cause not in self._logged:
            self._logged.add(cause)
            if isinstance(detail, PlanRow):
                r = detail
                detail = (
                    f"{r.keys} num_tokens {r.first}..{r.last} run {r.kind.upper()} ({r.reason})"
                )
            logger.info("%s: %s; logged once", self.name, detail)

    # ---------------------------------------------------------------------- report

    def _rows(self, uniform: bool) -> list[PlanRow]:
        """One row per route that holds some batch of the class, then the eager rest.

        A route covers the keys above the previous route's largest size up to its own.
        Short of FULL for uniform decode, or of PIECEWISE for mixed batches when the mode
        has it, is a downgrade (mode NONE asked for eager: none there).
        """
        step = self.query_len if uniform else 1
        label = f"uniform decode q={step}" if uniform else "mixed"
        best = Mode.FULL if uniform or not self.mode.has_piecewise else Mode.PIECEWISE
        routes, eager = self._specs[uniform]
        rows: list[PlanRow] = []
        covered = 0
        for kind, table, why in [*routes, (Mode.NONE, PaddingTable(()), eager)]:
            first = (covered // step + 1) * step
            last = (table.max_size if table.sizes else self.max_tokens) // step * step
            if first <= last:
                top = table.padded(last) or 0
                sizes = tuple(s for s in table.sizes if first <= s <= top)
                down = kind != best and self.mode is not Mode.NONE
                rows.append(PlanRow(label, first, last, step, kind, sizes, why, down))
            covered = max(covered, table.max_size)
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
            mark, sizes = "*" if r.downgrade else " ", _fmt_sizes(r.sizes)
            lines.append(
                f"{mark} {r.keys:<20} {rng:>14}  {r.kind.upper():<9}  {sizes:<24} {r.reason}"
            )
        beyond = f">{self.max_tokens}"
        lines.append(f"  {'any':<20} {beyond:>14}  {'EAGER':<9}  {'-':<24} above max_tokens")
        lines += [f"  note: {note}" for note in self.notes]
        if self.downgrades():
            lines.append("  * downgrade: not the best the mode offers (logged once)")
        return "\n".join(lines)

    __str__ = table

    def with_sizes(
        self, *, full: Sequence[int] | None = None, piecewise: Sequence[int] | None = None
    ) -> DispatchPlan:
        """The same policy over other sizes (those that captured; None keeps a kind's).

        A kind left with no sizes degrades the mode (FULL_AND_PIECEWISE without FULL
        graphs is PIECEWISE), noted first in the new plan and logged as a warning.
        """
        full, pw = (
            _given(full, self.full_sizes, "full"),
            _given(piecewise, self.piecewise_sizes, "piecewise"),
        )
        mode, note = _degraded(self.mode, not full, not pw)
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


def _given(new: Sequence[int] | None, old: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``with_sizes``' argument: None keeps ``old``, an empty list is "nothing captured"."""
    if new is None:
        return old
    return () if isinstance(new, (list, tuple)) and not new else validate_sizes(new, what=what)


def _degraded(mode: Mode, no_full: bool, no_piecewise: bool) -> tuple[Mode, str]:
    """The mode left when a kind of the mode captured nothing, and the note saying so."""
    no_full, no_piecewise = no_full and mode.has_full, no_piecewise and mode.has_piecewise
    if not (no_full or no_piecewise):
        return mode, ""
    keep_full, keep_pw = mode.has_full and not no_full, mode.has_piecewise and not no_piecewise
    left = Mode.FULL if keep_full else Mode.PIECEWISE if keep_pw else Mode.NONE
    gone = " and ".join(k for k, e in (("FULL", no_full), ("PIECEWISE", no_piecewise)) if e)
    return left, f"requested mode {mode.name}, but nothing captured for {gone}"
