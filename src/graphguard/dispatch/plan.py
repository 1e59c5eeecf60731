"""Which graph runs a batch: keys, decisions, and the policy that resolves them.

A :class:`BatchKey` is hashable, so it keys graphs; its relaxation (uniform or mixed ->
tokens-only) is the fallback order FULL -> PIECEWISE -> eager. :class:`DispatchPlan`
resolves a key at call time: each key class has routes in that order, each a padding table
of captured sizes with one :class:`Decision` per size made once, so ``max_tokens`` costs
nothing; the report rows (:class:`PlanRow`) are built from the sizes, not from every token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from graphguard.errors import ConfigError
from graphguard.mode import Mode
from graphguard.sizes import MAX_SIZE, PaddingTable, capture_sizes, is_int, validate_sizes

POSITIVE = "a positive int"
FLAG = "True or False"
_HOW = "BatchKey.decode(num_reqs, query_len) or BatchKey.mixed(num_tokens, num_reqs)"
_UNIFORM = "num_tokens / num_reqs in a uniform key (num_tokens == num_reqs * query_len)"


def _got(x: object) -> str:
    """A bad value as shown: an int, None or a str as its repr, anything else with its type."""
    kind = "" if is_int(x) or x is None or isinstance(x, str) else f"{type(x).__name__} "
    cast = " (pass int(...))" if hasattr(x, "__index__") and not isinstance(x, int) else ""
    return f"{kind}{x!r:.60}{cast}"


def failed(checks: Iterable[tuple[str, object, bool, str]]) -> list[str]:
    """``NAME must be WANT, got VALUE`` for each ``(name, value, ok, want)`` not ok: every
    mistake of one call in one message, not the first only."""
    return [f"{name} must be {want}, got {_got(v)}" for name, v, ok, want in checks if not ok]


def _count(x: object, least: int = 1) -> bool:
    return is_int(x) and x >= least


@dataclass(frozen=True)
class BatchKey:
    """What the dispatcher needs to know about one batch; hashable, so it can key graphs.

    ``num_tokens``: rows the model sees. ``num_reqs``: requests (None: a tokens-only key,
    what PIECEWISE graphs are keyed by). ``uniform``: every request has ``query_len``
    tokens (decode 1, a speculative verify ``1 + k``); only such batches replay FULL graphs,
    whose attention was captured for that layout. ``query_len`` is 0 for a mixed batch.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    query_len: int = 0

    def __post_init__(self) -> None:
        n, r, q, u = self.num_tokens, self.num_reqs, self.query_len, self.uniform
        bad = failed(
            [
                ("num_tokens", n, _count(n), POSITIVE),
                ("query_len", q, _count(q, 0), "an int >= 0"),
                ("num_reqs", r, r is None or _count(r), POSITIVE),
                ("uniform", u, isinstance(u, bool), FLAG),
            ]
        )
        if not bad:  # the layout, once every field is valid
            full = r is not None and n == r * q
            bad = failed(
                [
                    ("num_reqs", r, r is None or r <= n, f"at most num_tokens={n}"),
                    ("num_reqs", r, not u or r is not None, "given for a uniform key"),
                    ("query_len", q, not u or r is None or full, _UNIFORM),
                    ("query_len", q, u or q == 0, "0 in a mixed key"),
                ]
            )
        if bad:
            raise ConfigError(f"invalid BatchKey: {'; '.join(bad)}. Build keys with {_HOW}")

    @classmethod
    def decode(cls, num_reqs: int, query_len: int = 1) -> BatchKey:
        """A uniform batch: ``num_reqs`` requests of ``query_len`` tokens each."""
        r, q = num_reqs, query_len
        bad = failed([("num_reqs", r, _count(r), POSITIVE), ("query_len", q, _count(q), POSITIVE)])
        if bad:
            raise ConfigError("invalid BatchKey.decode(num_reqs, query_len): " + "; ".join(bad))
        return cls(num_reqs * query_len, num_reqs, True, query_len)

    @classmethod
    def mixed(cls, num_tokens: int, num_reqs: int | None = None) -> BatchKey:
        """A batch whose requests have different query lengths (prefill chunks + decodes)."""
        return cls(num_tokens, num_reqs, False, 0)

    def relax(self) -> BatchKey | None:
        """The next key in the fallback order (tokens-only), or None when only eager remains."""
        return BatchKey(self.num_tokens) if self.num_reqs is not None else None

    def relaxations(self) -> tuple[BatchKey, ...]:
        """This key followed by every relaxation, in fallback order."""
        relaxed = self.relax()
        return (self,) if relaxed is None else (self, *relaxed.relaxations())

    def __str__(self) -> str:
        if self.uniform:
            return f"decode(reqs={self.num_reqs}, q={self.query_len}, tokens={self.num_tokens})"
        if self.num_reqs is not None:
            return f"mixed(tokens={self.num_tokens}, reqs={self.num_reqs})"
        return f"tokens({self.num_tokens})"


@dataclass(frozen=True)
class Decision:
    """What runs a batch: ``kind`` (FULL, PIECEWISE or NONE: eager), the captured key it
    replays (for eager the batch's tokens-only key), and why."""

    kind: Mode
    padded_key: BatchKey
    reason: str

    @property
    def size(self) -> int:
        """Token count the batch runs at (the captured size, or its own for eager)."""
        return self.padded_key.num_tokens


@dataclass(frozen=True)
class PlanRow:
    """One line of the plan report: a class of keys over a token range, and its fate."""

    keys: str
    first: int
    last: int
    step: int
    kind: Mode
    sizes: tuple[int, ...]
    reason: str
    downgrade: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON); ``num_tokens`` is ``[first, last]``."""
        out = {k: v for k, v in vars(self).items() if k not in ("first", "last")}
        kind, sizes = self.kind.value, list(self.sizes)
        return {**out, "num_tokens": [self.first, self.last], "kind": kind, "sizes": sizes}


logger = logging.getLogger("graphguard")

_MAX_TOKENS = "a positive int (the largest batch, in tokens, the engine schedules)"
_QUERY_LEN = "a positive int (1 for decode, 1 + k with k speculative tokens)"
_KIND = {Mode.FULL: "FULL", Mode.PIECEWISE: "piecewise"}
_FIRST = {
    (True, Mode.FULL): "uniform decode q={q}: FULL graph",
    (True, Mode.PIECEWISE): "mode PIECEWISE: uniform decode keys use piecewise graphs",
    (False, Mode.PIECEWISE): "mixed batch: piecewise graphs",
    (False, Mode.FULL): "mode FULL with full_mixed: mixed batches replay FULL graphs",
}
"""Why the first route of a key class (uniform?, kind) runs it."""
_EAGER = {
    True: "mode NONE: every batch runs eagerly",
    False: "mode FULL: mixed batches run eagerly (FULL graphs serve uniform decode batches; "
    "use FULL_AND_PIECEWISE, or full_mixed=True if the callable handles ragged batches)",
}
"""Why a key class with no route runs eagerly (keyed by mode is NONE)."""


class _Route:
    """One fallback step of a key class: a kind, its padding table, why, and the decision
    for each captured size (made once, so a replaying batch allocates nothing)."""

    __slots__ = ("decisions", "kind", "padded", "table", "why")

    def __init__(self, kind: Mode, table: PaddingTable, why: str, uniform: bool, q: int) -> None:
        self.kind, self.table, self.why, self.padded = kind, table, why, table.padded
        full = uniform and kind is Mode.FULL
        keys = {s: BatchKey.decode(s // q, q) if full else BatchKey(s) for s in table.sizes}
        self.decisions = {s: Decision(kind, k, why) for s, k in keys.items()}


def _check_sizes(what: str, sizes: Sequence[int] | None, top: int, q: int) -> tuple[int, ...]:
    """A kind's sizes (default: the ladder up to ``top``), all <= ``top``, multiples of ``q``."""
    hint = "graphguard.capture_sizes({}" + (f", multiple_of={q})" if q > 1 else ")")
    if sizes is None and top > MAX_SIZE:
        raise ConfigError(
            f"DispatchPlan: the default {what} run up to max_tokens={top}, past the largest "
            f"capture size {MAX_SIZE} (one graph per size). Pass {what}= (e.g. "
            f"{hint.format(8192)}; larger batches run eagerly) or lower max_tokens"
        )
    out = validate_sizes(capture_sizes(top, multiple_of=q) if sizes is None else sizes, what=what)
    above, odd = [s for s in out if s > top], [s for s in out if s % q]
    bad = [f"{above[:10]} are above max_tokens={top}"] if above else []
    bad += [f"{out[-1]} is above the largest capture size {MAX_SIZE}"] if out[-1] > MAX_SIZE else []
    if odd:
        bad.append(
            f"{odd[:10]} are not multiples of query_len={q} (a uniform batch of {q}-token "
            "requests never has that many tokens)"
        )
    if bad:
        raise ConfigError(
            f"{what}: " + "; ".join(bad) + f". Use e.g. {hint.format(min(top, MAX_SIZE))}."
        )
    return out


def fmt_sizes(s: Sequence[int]) -> str:
    return ",".join(map(str, s)) or "-" if len(s) <= 6 else f"{s[0]},{s[1]},..,{s[-1]} ({len(s)})"


class DispatchPlan:
    """The policy: for every batch key, FULL, PIECEWISE or eager, and why.

    ``max_tokens``: the largest batch (tokens) the engine schedules; larger ones run
    eagerly, and it ends the default ladders (``full_sizes``: ``capture_sizes(max_tokens,
    multiple_of=query_len)``, ``piecewise_sizes``: ``capture_sizes(max_tokens)``).
    ``query_len``: tokens per request of the uniform batches FULL graphs serve (1 for
    decode, ``1 + k`` with ``k`` speculative tokens). ``full_mixed`` (mode FULL only):
    mixed batches replay the FULL graphs (the callable's attention handles ragged batches).
    Every downgrade (not the best the mode offers) is a row of :meth:`table`, logged once.
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
        q, top = query_len, max_tokens
        bad = failed(
            [
                ("max_tokens", top, is_int(top) and top >= 1, _MAX_TOKENS),
                ("query_len", q, is_int(q) and q >= 1, _QUERY_LEN),
                ("full_mixed", full_mixed, isinstance(full_mixed, bool), FLAG),
                ("name", name, isinstance(name, str), "a string"),
            ]
        )
        if not bad and top < q:
            bad.append(
                f"max_tokens={top} is below query_len={q}: no uniform batch of {q}-token "
                f"requests fits. Raise max_tokens (e.g. max_batch * {q} + a prefill chunk) or "
                "lower query_len"
            )
        if bad:
            raise ConfigError("DispatchPlan: " + "; ".join(bad))
        self.name, self.max_tokens, self.query_len = name, top, q
        self.full_mixed = full_mixed and m is Mode.FULL
        self.full_sizes = _check_sizes("full_sizes", full_sizes, top, q) if m.has_full else ()
        self.piecewise_sizes = (
            _check_sizes("piecewise_sizes", piecewise_sizes, top, 1) if m.has_piecewise else ()
        )
        self.notes: list[str] = [
            f"mode {m.name}: {what} ignored ({why})"
            for ignored, what, why in (
                (full_sizes and not m.has_full, "full_sizes", "no FULL graphs"),
                (piecewise_sizes and not m.has_piecewise, "piecewise_sizes", "no piecewise graphs"),
                (full_mixed and m is not Mode.FULL, "full_mixed", "it only applies to mode FULL"),
            )
            if ignored
        ]
        if m.has_full and q > 1:
            then = "piecewise graphs" if m.has_piecewise else "eager"
            self.notes += [
                f"spec decode q={q}: FULL sizes are multiples of {q} ({q} tokens per request)",
                f"uniform batches with a query length other than {q} are relaxed to "
                f"tokens-only keys: {then}",
            ]
        self._logged: set[str] = set()
        tables = (PaddingTable(self.full_sizes), PaddingTable(self.piecewise_sizes))
        # Indexed by the key class ``uniform``, a bool: [False] mixed, [True] uniform decode.
        self._classes = (self._routes(False, *tables), self._routes(True, *tables))
        self._lookups = tuple([(r.padded, r.decisions) for r in c[0]] for c in self._classes)
        self.rows = self._rows(True) + self._rows(False)
        for r in self.downgrades():
            run = f"num_tokens {r.first}..{r.last} run {r.kind.upper()} ({r.reason})"
            self._log_once(f"{r.keys}: {r.reason}", f"{r.keys} {run}")

    # ------------------------------------------------------------------ resolution

    def _routes(
        self, uniform: bool, full: PaddingTable, pw: PaddingTable
    ) -> tuple[list[_Route], str]:
        """One key class's routes in fallback order (FULL, then PIECEWISE), and why the rest
        runs eagerly: each route takes the batches above the largest size before it."""
        m, q = self.mode, self.query_len
        routes: list[_Route] = []
        above = ""
        for on, kind, table in (
            (m.has_full if uniform else self.full_mixed, Mode.FULL, full),
            (m.has_piecewise, Mode.PIECEWISE, pw),
        ):
            if on:
                why = f"{above}: piecewise graphs" if above else _FIRST[uniform, kind]
                routes.append(_Route(kind, table, why.format(q=q), uniform, q))
                above += (" and > " if above else "num_tokens > ") + f"largest {_KIND[kind]}"
                above += f" size {table.max_size}"
        return routes, f"{above}: eager" if above else _EAGER[m is Mode.NONE]

    def resolve(self, key: BatchKey) -> Decision:
        """The decision for ``key``: one padding-table lookup per route tried. A uniform key
        at another query length than the FULL graphs' is relaxed to tokens-only, a batch above
        ``max_tokens`` runs eagerly; each cause logged once."""
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
        for padded, decisions in self._lookups[uniform]:
            p = padded(n)  # None above the route's largest size, so above max_tokens too
            if p is not None:
                return decisions[p]
        if n > self.max_tokens:
            return self._above(n)
        return Decision(Mode.NONE, BatchKey(n), self._classes[uniform][1])

    def _relaxed(self, key: BatchKey) -> Decision:
        inner = self.resolve(BatchKey(key.num_tokens))
        reason = (
            f"uniform decode q={key.query_len} but FULL graphs serve q={self.query_len}: "
            f"relaxed to tokens-only, {inner.reason}"
        )
        self._log_once(f"query_len {key.query_len}", reason)
        return Decision(inner.kind, inner.padded_key, reason)

    def _above(self, n: int) -> Decision:
        reason = self._classes[False][1]
        if self.mode is not Mode.NONE:
            reason = f"num_tokens {n} > max_tokens {self.max_tokens}: eager"
            self._log_once("above max_tokens", reason)
        return Decision(Mode.NONE, BatchKey(n), reason)

    def _log_once(self, cause: str, detail: str) -> None:
        if cause not in self._logged:
            self._logged.add(cause)
            logger.info("%s: %s; logged once", self.name, detail)

    # ---------------------------------------------------------------------- report

    def _rows(self, uniform: bool) -> list[PlanRow]:
        """One row per route holding some batch of the class (above the previous route's
        largest size, up to its own), then the eager rest. Short of FULL for uniform decode,
        or of PIECEWISE for mixed batches when the mode has it, is a downgrade."""
        step = self.query_len if uniform else 1
        label = f"uniform decode q={step}" if uniform else "mixed"
        best = Mode.FULL if uniform or not self.mode.has_piecewise else Mode.PIECEWISE
        routes, eager = self._classes[uniform]
        rows: list[PlanRow] = []
        covered = 0
        steps = [(r.kind, r.table, r.why) for r in routes] + [(Mode.NONE, PaddingTable(()), eager)]
        for kind, table, why in steps:
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
        out = {k: getattr(self, k) for k in ("name", "max_tokens", "query_len", "full_mixed")}
        return {
            **out,
            "mode": self.mode.value,
            **{k: list(getattr(self, k)) for k in ("full_sizes", "piecewise_sizes", "notes")},
            "rows": [r.to_dict() for r in self.rows],
            "beyond": f"num_tokens > {self.max_tokens} (max_tokens): eager",
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
            mark, sizes = "*" if r.downgrade else " ", fmt_sizes(r.sizes)
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
        """The same policy over other sizes (those that captured; None keeps a kind's). A
        kind left with none degrades the mode, noted first in the new plan and warned."""
        f = self.full_sizes if full is None else _given(full, "full")
        p = self.piecewise_sizes if piecewise is None else _given(piecewise, "piecewise")
        m = self.mode
        mode = _MODES[m.has_full and bool(f)][m.has_piecewise and bool(p)]
        lost = [("FULL", m.has_full and not f), ("PIECEWISE", m.has_piecewise and not p)]
        gone = " and ".join(k for k, x in lost if x)
        note = f"requested mode {m.name}, but nothing captured for {gone}" if gone else ""
        if note:
            logger.warning("%s: %s; running as mode %s", self.name, note, mode.name)
        plan = DispatchPlan(
            mode,
            max_tokens=self.max_tokens,
            full_sizes=f if mode.has_full else None,
            piecewise_sizes=p if mode.has_piecewise else None,
            query_len=self.query_len,
            full_mixed=self.full_mixed,
            name=self.name,
        )
        plan.notes[:0] = [note] if note else []
        return plan


_MODES = ((Mode.NONE, Mode.PIECEWISE), (Mode.FULL, Mode.FULL_AND_PIECEWISE))
"""The mode of what a plan has: ``_MODES[has FULL graphs][has piecewise graphs]``."""


def _given(new: Sequence[int], what: str) -> tuple[int, ...]:
    """``with_sizes``' argument: an empty list is "nothing captured", else valid sizes."""
    return () if isinstance(new, (list, tuple)) and not new else validate_sizes(new, what=what)
