"""The resolved dispatch policy: for every batch key, FULL, PIECEWISE or eager, and why.

Contract: a :class:`DispatchPlan` is built once from the mode and the capture sizes and
precomputes a :class:`~graphguard.keys.Decision` for every token count up to
``max_tokens``, so :meth:`DispatchPlan.resolve` is one list index on the serving path.
Sizes are validated at construction (above ``max_tokens`` or not a multiple of
``query_len`` raises :class:`~graphguard.errors.ConfigError` with a suggested ladder).
Every place where what runs is not the best the mode offers is a *downgrade*; the plan
lists them (:meth:`DispatchPlan.table`, :meth:`DispatchPlan.to_dict`) before anything is
captured and logs each once. :meth:`DispatchPlan.with_sizes` narrows the plan to the
sizes that actually captured (a kind that captured nothing degrades the mode).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any

from graphguard.config import Mode
from graphguard.errors import ConfigError
from graphguard.keys import BatchKey, Decision, PlanRow, _is_int
from graphguard.sizes import PaddingTable, capture_sizes, validate_sizes

logger = logging.getLogger("graphguard")


def _check_sizes(
    what: str, sizes: Sequence[int], max_tokens: int, multiple_of: int
) -> tuple[int, ...]:
    out = validate_sizes(sizes, what=what)
    problems = []
    above = [s for s in out if s > max_tokens]
    if above:
        problems.append(f"{above} are above max_tokens={max_tokens}")
    if multiple_of > 1:
        odd = [s for s in out if s % multiple_of]
        if odd:
            problems.append(
                f"{odd} are not multiples of query_len={multiple_of} (a uniform batch of "
                f"{multiple_of}-token requests never has that many tokens)"
            )
    if problems:
        hint = f"graphguard.capture_sizes({max_tokens}"
        hint += f", multiple_of={multiple_of})" if multiple_of > 1 else ")"
        raise ConfigError(f"{what}: " + "; ".join(problems) + f". Use e.g. {hint}.")
    return out


def _fmt_sizes(sizes: Sequence[int]) -> str:
    if not sizes:
        return "-"
    if len(sizes) <= 6:
        return ",".join(map(str, sizes))
    return f"{sizes[0]},{sizes[1]},..,{sizes[-1]} ({len(sizes)})"


class DispatchPlan:
    """The resolved policy: for every batch key, FULL, PIECEWISE or eager, and why.

    Args:
        mode: :class:`~graphguard.config.Mode` or its name.
        full_sizes: token counts with a FULL graph (uniform batches). Default
            ``capture_sizes(max_tokens, multiple_of=query_len)``. Must be multiples of
            ``query_len``: a uniform batch of ``q``-token requests only has multiples of
            ``q`` tokens, so any other size would be dead weight in the graph pool.
        piecewise_sizes: token counts with piecewise graphs. Default
            ``capture_sizes(max_tokens)``.
        max_tokens: the largest batch the engine schedules; the plan precomputes every
            decision up to it. Larger batches resolve to eager.
        query_len: tokens per request of the uniform batches the FULL graphs serve
            (1 for decode, ``1 + k`` with ``k`` speculative tokens).
        full_mixed: in mode FULL only, whether mixed batches may replay the FULL graphs
            (true when the captured callable's attention handles ragged batches).
            Otherwise mixed batches run eagerly in mode FULL (a listed downgrade).
        name: shown in logs.

    ``resolve`` is one list index for keys up to ``max_tokens``; nothing on that path
    allocates or logs.
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
        self.mode = Mode.parse(mode)
        self.name = name
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if not _is_int(query_len) or query_len < 1:
            raise ConfigError(f"query_len must be a positive int, got {query_len!r}")
        if query_len > max_tokens:
            raise ConfigError(f"query_len={query_len} is larger than max_tokens={max_tokens}")
        if not isinstance(full_mixed, bool):
            raise ConfigError(f"full_mixed must be True or False, got {full_mixed!r}")
        self.max_tokens = max_tokens
        self.query_len = query_len
        self.full_mixed = bool(full_mixed) and self.mode is Mode.FULL
        self.notes: list[str] = []
        if self.mode.has_full:
            self.full_sizes = _check_sizes(
                "full_sizes",
                full_sizes
                if full_sizes is not None
                else capture_sizes(max_tokens, multiple_of=query_len),
                max_tokens,
                query_len,
            )
            if query_len > 1:
                self.notes.append(
                    f"spec decode q={query_len}: FULL sizes are multiples of {query_len} "
                    f"({query_len} tokens per request)"
                )
        else:
            self.full_sizes = ()
            if full_sizes:
                self.notes.append(f"mode {self.mode.name}: full_sizes ignored (no FULL graphs)")
        if self.mode.has_piecewise:
            self.piecewise_sizes = _check_sizes(
                "piecewise_sizes",
                piecewise_sizes if piecewise_sizes is not None else capture_sizes(max_tokens),
                max_tokens,
                1,
            )
        else:
            self.piecewise_sizes = ()
            if piecewise_sizes:
                self.notes.append(
                    f"mode {self.mode.name}: piecewise_sizes ignored (no piecewise graphs)"
                )
        if full_mixed and self.mode is not Mode.FULL:
            self.notes.append(
                f"mode {self.mode.name}: full_mixed ignored (it only applies to mode FULL)"
            )
        if self.mode.has_full and query_len > 1:
            self.notes.append(
                f"uniform batches with a query length other than {query_len} are relaxed to "
                "tokens-only keys: " + ("piecewise graphs" if self.mode.has_piecewise else "eager")
            )
        self._full = PaddingTable(self.full_sizes)
        self._piecewise = PaddingTable(self.piecewise_sizes)
        self._cache: dict[tuple[Mode, int, str], Decision] = {}
        self._uniform: list[Decision | None] = [None] * (max_tokens + 1)
        self._mixed: list[Decision | None] = [None] * (max_tokens + 1)
        # Decisions are constant between consecutive capture sizes (the padded size is),
        # so one decision per segment fills a slice: linear in max_tokens with a tiny
        # constant (a million tokens in well under a second). Eager entries hold a
        # template; resolve() rebuilds them around the caller's key.
        self._segments: dict[bool, list[tuple[int, int, Decision]]] = {True: [], False: []}
        q = query_len
        # The collector would rescan the two big tables on every generation-2 pass while
        # the decisions are built (seconds at a million tokens); nothing here is cyclic.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._fill_tables(q)
        finally:
            if gc_was_enabled:
                gc.enable()
        self._cache.clear()
        self._logged: set[str] = set()
        self.rows = self._rows()
        for row in self.rows:
            if row.downgrade:
                self._log_once(f"{row.keys}: {row.reason}", row)

    def _fill_tables(self, q: int) -> None:
        lo = 0
        for hi in sorted({*self.full_sizes, *self.piecewise_sizes, self.max_tokens}):
            dm = self._decide_mixed(hi)
            self._mixed[lo + 1 : hi + 1] = [dm] * (hi - lo)
            self._segments[False].append((lo + 1, hi, dm))
            first = (lo // q + 1) * q
            if first <= hi:
                du = self._decide_uniform(first)
                count = (hi - first) // q + 1
                self._uniform[first : hi + 1 : q] = [du] * count
                self._segments[True].append((first, first + (count - 1) * q, du))
            lo = hi

    # ------------------------------------------------------------- decisions

    def _decision(self, kind: Mode, size: int, reason: str, uniform: bool) -> Decision:
        ck = (kind, size, reason)
        d = self._cache.get(ck)
        if d is None:
            if kind is Mode.FULL and uniform:
                key = BatchKey.decode(size // self.query_len, self.query_len)
            else:
                key = BatchKey(size)
            d = Decision(kind, key, reason)
            self._cache[ck] = d
        return d

    def _decide_uniform(self, n: int) -> Decision:
        q = self.query_len
        if self.mode is Mode.NONE:
            return self._decision(Mode.NONE, n, "mode NONE: every batch runs eagerly", True)
        if self.mode.has_full:
            p = self._full.padded(n)
            if p is not None:
                return self._decision(Mode.FULL, p, f"uniform decode q={q}: FULL graph", True)
            beyond = (
                f"num_tokens > largest FULL size {self._full.max_size}"
                if self.full_sizes
                else "no FULL sizes"
            )
            if self.mode.has_piecewise:
                p = self._piecewise.padded(n)
                if p is not None:
                    return self._decision(Mode.PIECEWISE, p, f"{beyond}: piecewise graphs", True)
                return self._decision(
                    Mode.NONE,
                    n,
                    f"{beyond} and > largest piecewise size {self._piecewise.max_size}: eager",
                    True,
                )
            return self._decision(Mode.NONE, n, f"{beyond}: eager", True)
        p = self._piecewise.padded(n)
        if p is not None:
            return self._decision(
                Mode.PIECEWISE, p, "mode PIECEWISE: uniform decode keys use piecewise graphs", True
            )
        return self._decision(
            Mode.NONE,
            n,
            f"num_tokens > largest piecewise size {self._piecewise.max_size}: eager",
            True,
        )

    def _decide_mixed(self, n: int) -> Decision:
        if self.mode is Mode.NONE:
            return self._decision(Mode.NONE, n, "mode NONE: every batch runs eagerly", False)
        if self.mode.has_piecewise:
            p = self._piecewise.padded(n)
            if p is not None:
                return self._decision(Mode.PIECEWISE, p, "mixed batch: piecewise graphs", False)
            return self._decision(
                Mode.NONE,
                n,
                f"num_tokens > largest piecewise size {self._piecewise.max_size}: eager",
                False,
            )
        if self.full_mixed:
            p = self._full.padded(n)
            if p is not None:
                return self._decision(
                    Mode.FULL,
                    p,
                    "mode FULL with full_mixed: mixed batches replay FULL graphs",
                    False,
                )
            return self._decision(
                Mode.NONE, n, f"num_tokens > largest FULL size {self._full.max_size}: eager", False
            )
        return self._decision(
            Mode.NONE,
            n,
            "mode FULL: mixed batches run eagerly (FULL graphs serve uniform decode batches; "
            "use FULL_AND_PIECEWISE, or full_mixed=True if the callable handles ragged batches)",
            False,
        )

    def resolve(self, key: BatchKey) -> Decision:
        """The decision for ``key``: one list index for keys up to ``max_tokens``.

        Keys outside the precomputed tables (above ``max_tokens``, or uniform with a
        query length the FULL graphs were not captured for) take a slower path that
        relaxes the key and logs the downgrade once per cause.
        """
        n = key.num_tokens
        if key.uniform and key.query_len == self.query_len:
            if n <= self.max_tokens:
                d = self._uniform[n]
                if d is not None:
                    return (
                        d if d.kind is not Mode.NONE else Decision(Mode.NONE, BatchKey(n), d.reason)
                    )
        elif key.uniform and self.mode.has_full:
            return self._resolve_relaxed(key)
        elif n <= self.max_tokens:
            d = self._mixed[n]
            if d is not None:
                return d if d.kind is not Mode.NONE else Decision(Mode.NONE, BatchKey(n), d.reason)
        return self._resolve_slow(key)

    def _resolve_relaxed(self, key: BatchKey) -> Decision:
        relaxed = key.relax()
        assert relaxed is not None
        inner = self.resolve(relaxed)
        reason = (
            f"uniform decode q={key.query_len} but FULL graphs serve q={self.query_len}: "
            f"relaxed to tokens-only, {inner.reason}"
        )
        self._log_once(f"query_len {key.query_len}", reason)
        return Decision(inner.kind, inner.padded_key, reason)

    def _resolve_slow(self, key: BatchKey) -> Decision:
        n = key.num_tokens
        if self.mode is Mode.NONE:
            return Decision(Mode.NONE, key, "mode NONE: every batch runs eagerly")
        reason = f"num_tokens {n} > max_tokens {self.max_tokens}: eager"
        self._log_once("above max_tokens", reason)
        return Decision(Mode.NONE, key, reason)

    def _log_once(self, cause: str, detail: Any) -> None:
        if cause in self._logged:
            return
        self._logged.add(cause)
        if isinstance(detail, PlanRow):
            logger.info(
                "%s: %s num_tokens %d..%d run %s (%s); logged once",
                self.name,
                detail.keys,
                detail.first,
                detail.last,
                detail.kind.upper(),
                detail.reason,
            )
        else:
            logger.info("%s: %s; logged once", self.name, detail)

    # ----------------------------------------------------------------- report

    def _best(self, uniform: bool) -> Mode:
        """What a key class would ideally get: FULL for uniform decode, else PIECEWISE.

        Anything less is a downgrade and is listed, including the ones the mode implies
        (mode PIECEWISE runs uniform decode piecewise), because that is a choice the
        reader should see. Mode NONE asked for eager, so nothing there is a downgrade.
        """
        if uniform or not self.mode.has_piecewise:
            return Mode.FULL
        return Mode.PIECEWISE

    def _rows(self) -> list[PlanRow]:
        rows: list[PlanRow] = []
        q = self.query_len
        for label, uniform, step in ((f"uniform decode q={q}", True, q), ("mixed", False, 1)):
            best = self._best(uniform)
            start = last = 0
            prev: Decision | None = None
            for first, end, d in self._segments[uniform]:
                if prev is not None and (d.kind, d.reason) == (prev.kind, prev.reason):
                    last = end
                    continue
                if prev is not None:
                    rows.append(self._row(label, start, last, step, prev, best))
                start, last, prev = first, end, d
            if prev is not None:
                rows.append(self._row(label, start, last, step, prev, best))
        return rows

    def _row(
        self, label: str, first: int, last: int, step: int, d: Decision, best: Mode
    ) -> PlanRow:
        pool = {Mode.FULL: self.full_sizes, Mode.PIECEWISE: self.piecewise_sizes}.get(d.kind, ())
        hi = self._pad(d.kind, last) or last
        sizes = tuple(s for s in pool if first <= s <= hi)
        downgrade = d.kind != best and self.mode is not Mode.NONE
        return PlanRow(label, first, last, step, d.kind, sizes, d.reason, downgrade)

    def _pad(self, kind: Mode, n: int) -> int | None:
        if kind is Mode.FULL:
            return self._full.padded(n)
        if kind is Mode.PIECEWISE:
            return self._piecewise.padded(n)
        return None

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
        head = (
            f"dispatch plan {self.name!r}: mode {self.mode.value}, max_tokens {self.max_tokens}"
            + (f", query_len {self.query_len}" if self.query_len > 1 else "")
        )
        lines = [
            head,
            f"  {'keys':<20} {'num_tokens':>14}  {'kind':<9}  {'graphs (tokens)':<24} reason",
        ]
        for r in self.rows:
            rng = f"{r.first}..{r.last}" if r.first != r.last else str(r.first)
            if r.step > 1 and r.first != r.last:
                rng += f"/{r.step}"
            lines.append(
                f"{'*' if r.downgrade else ' '} {r.keys:<20} {rng:>14}  {r.kind.upper():<9}  "
                f"{_fmt_sizes(r.sizes):<24} {r.reason}"
            )
        lines.append(
            f"  {'any':<20} {'>' + str(self.max_tokens):>14}  {'EAGER':<9}  "
            f"{'-':<24} above max_tokens"
        )
        for note in self.notes:
            lines.append(f"  note: {note}")
        if any(r.downgrade for r in self.rows):
            lines.append("  * downgrade: not the best the mode offers (logged once)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def with_sizes(
        self, *, full: Sequence[int] | None = None, piecewise: Sequence[int] | None = None
    ) -> DispatchPlan:
        """The same policy over other sizes (e.g. those that actually captured).

        Sizes not given stay as they are. A plan with no sizes of a kind sends those
        keys down the fallback order, which the new plan's report shows.
        """
        kw: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "query_len": self.query_len,
            "full_mixed": self.full_mixed,
            "name": self.name,
        }
        if self.mode.has_full:
            kw["full_sizes"] = list(full) if full is not None else list(self.full_sizes)
        if self.mode.has_piecewise:
            kw["piecewise_sizes"] = (
                list(piecewise) if piecewise is not None else list(self.piecewise_sizes)
            )
        # validate_sizes rejects an empty list; an empty kind means "nothing captured".
        empty_full = "full_sizes" in kw and not kw["full_sizes"]
        empty_pw = "piecewise_sizes" in kw and not kw["piecewise_sizes"]
        if empty_full or empty_pw:
            return _EmptyAware.build(self, kw, empty_full, empty_pw)
        return DispatchPlan(self.mode, **kw)


class _EmptyAware:
    """Builds a plan where a kind captured nothing (every size failed or was skipped)."""

    @staticmethod
    def build(
        base: DispatchPlan, kw: dict[str, Any], empty_full: bool, empty_pw: bool
    ) -> DispatchPlan:
        mode = base.mode
        if empty_full and empty_pw:
            mode = Mode.NONE
        elif empty_full:
            mode = Mode.PIECEWISE if mode.has_piecewise else Mode.NONE
        elif empty_pw:
            mode = Mode.FULL if mode.has_full else Mode.NONE
        note = f"requested mode {base.mode.name}, but nothing captured for " + " and ".join(
            k for k, e in (("FULL", empty_full), ("PIECEWISE", empty_pw)) if e
        )
        logger.warning("%s: %s; running as mode %s", base.name, note, mode.name)
        kw = dict(kw)
        if not mode.has_full:
            kw.pop("full_sizes", None)
        if not mode.has_piecewise:
            kw.pop("piecewise_sizes", None)
        plan = DispatchPlan(mode, **kw)
        plan.notes.insert(0, note)
        return plan


__all__ = ["DispatchPlan"]
