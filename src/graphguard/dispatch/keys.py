"""What a batch is (:class:`BatchKey`), what runs it (:class:`Decision`), one report row.

A key is hashable, so it keys graphs; its *relaxation* (uniform or mixed -> tokens-only)
is the fallback order FULL -> PIECEWISE -> eager. A bad key is a ConfigError naming the
field when it is built, never a wrong graph later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphguard.config import Mode
from graphguard.errors import ConfigError
from graphguard.sizes import is_int

_HOW = "BatchKey.decode(num_reqs, query_len) or BatchKey.mixed(num_tokens, num_reqs)"


def _bad_count(name: str, x: object, least: int) -> list[str]:
    """Why ``x`` is not an int >= ``least`` (a bool is not a count), if it is not."""
    if is_int(x) and x >= least:  # type: ignore[operator]
        return []
    want = "a positive int" if least == 1 else f"an int >= {least}"
    kind = "" if is_int(x) else f" {type(x).__name__}"
    cast = " (pass int(...))" if hasattr(x, "__index__") and not isinstance(x, int) else ""
    return [f"{name} must be {want}, got{kind} {x!r:.60}{cast}"]


@dataclass(frozen=True)
class BatchKey:
    """What the dispatcher needs to know about one batch; hashable, so it can key graphs.

    Attributes:
        num_tokens: tokens in the batch (the rows the model sees).
        num_reqs: requests in the batch; ``None`` for a tokens-only key (what the
            PIECEWISE graphs are keyed by).
        uniform: every request has ``query_len`` tokens: a decode step (1) or a
            speculative verify step (``1 + k``). Only such batches replay FULL graphs,
            whose attention was captured for that layout.
        query_len: tokens per request of a uniform batch; 0 for a mixed batch.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    query_len: int = 0

    def __post_init__(self) -> None:
        n, r, q, uniform = self.num_tokens, self.num_reqs, self.query_len, self.uniform
        bad = _bad_count("num_tokens", n, 1) + _bad_count("query_len", q, 0)
        bad += [] if r is None else _bad_count("num_reqs", r, 1)
        if not isinstance(uniform, bool):
            bad.append(f"uniform must be True or False, got {uniform!r:.60}")
        elif bad:
            pass  # the layout checks below need valid fields
        elif r is not None and r > n:
            bad.append(f"num_reqs must be in 1..num_tokens, got {r} > {n}")
        elif uniform and (q < 1 or r is None):
            bad.append("a uniform key needs num_reqs and query_len >= 1")
        elif uniform and n != r * q:  # type: ignore[operator]
            bad.append(
                f"a uniform key has num_tokens == num_reqs * query_len, got {n} != {r} * {q}"
            )
        elif not uniform and q != 0:
            bad.append(f"a mixed key has query_len 0, got {q}")
        if bad:
            raise ConfigError("invalid BatchKey: " + "; ".join(bad) + f". Build keys with {_HOW}")

    @classmethod
    def decode(cls, num_reqs: int, query_len: int = 1) -> BatchKey:
        """A uniform batch: ``num_reqs`` requests of ``query_len`` tokens each."""
        bad = _bad_count("num_reqs", num_reqs, 1) + _bad_count("query_len", query_len, 1)
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
    """What runs a batch: ``kind`` (FULL, PIECEWISE or NONE: eager), the key, and why.

    ``padded_key`` is the captured key replayed, or for eager the batch's tokens-only key.
    """

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
        return {
            **out,
            "num_tokens": [self.first, self.last],
            "kind": self.kind.value,
            "sizes": list(self.sizes),
        }
