"""What a batch is (:class:`BatchKey`), what runs it (:class:`Decision`), one report row.

A key is hashable, so it keys graphs; its relaxation (uniform or mixed -> tokens-only) is
the fallback order FULL -> PIECEWISE -> eager. A bad key is a ConfigError naming the field
when it is built, never a wrong graph later. :func:`failed` is the package's one argument check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from graphguard.config import Mode
from graphguard.errors import ConfigError
from graphguard.sizes import is_int

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
        bad = failed(
            [
                ("num_reqs", num_reqs, _count(num_reqs), POSITIVE),
                ("query_len", query_len, _count(query_len), POSITIVE),
            ]
        )
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
