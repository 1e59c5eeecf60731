"""The value types of dispatch: what a batch is, what runs it, one row of the plan report.

Contract: a :class:`BatchKey` describes one engine step (tokens, requests, whether every
request has the same query length) and is hashable, so it keys graphs; its
*relaxation* (uniform -> tokens-only) is the fallback order FULL -> PIECEWISE -> eager.
A :class:`Decision` is what :class:`~graphguard.plan.DispatchPlan` resolves a key to
(the mode, the captured key it pads to, and why); a :class:`PlanRow` is one line of the
plan table, listed before anything is captured so a downgrade to eager is visible up
front. Construction validates: a bool is not a token count, and a bad key raises
:class:`~graphguard.errors.ConfigError` naming the field. Import them from
:mod:`graphguard.dispatch` (re-exported there) or from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphguard.config import Mode
from graphguard.errors import ConfigError


def _is_int(x: object) -> bool:
    """An int that is not a bool (``BatchKey(True)`` must not mean one token)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class BatchKey:
    """What the dispatcher needs to know about one batch; hashable, so it can key graphs.

    Attributes:
        num_tokens: tokens in the batch (the rows the model sees).
        num_reqs: requests in the batch; ``None`` for a tokens-only key (what the
            PIECEWISE graphs are keyed by).
        uniform: every request has the same query length (``query_len``): a decode
            step (``query_len=1``) or a speculative-decode verify step
            (``query_len=1+k``). Only such batches can replay FULL graphs, because the
            attention inside them was captured for that layout.
        query_len: tokens per request of a uniform batch; 0 for a mixed batch.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    query_len: int = 0

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not _is_int(self.num_tokens) or self.num_tokens < 1:
            problems.append(f"num_tokens must be a positive int, got {self.num_tokens!r}")
        if self.num_reqs is not None and (
            not _is_int(self.num_reqs)
            or self.num_reqs < 1
            or (_is_int(self.num_tokens) and self.num_reqs > self.num_tokens)
        ):
            problems.append(
                f"num_reqs must be an int in 1..num_tokens or None, got {self.num_reqs!r}"
            )
        if not isinstance(self.uniform, bool):
            problems.append(f"uniform must be True or False, got {self.uniform!r}")
        if not _is_int(self.query_len) or self.query_len < 0:
            problems.append(f"query_len must be an int >= 0, got {self.query_len!r}")
        if problems:
            raise ConfigError(
                "invalid BatchKey: " + "; ".join(problems) + ". Build keys with "
                "BatchKey.decode(num_reqs, query_len) or BatchKey.mixed(num_tokens, num_reqs)"
            )
        if self.uniform:
            if self.query_len < 1 or self.num_reqs is None:
                problems.append("a uniform key needs num_reqs and query_len >= 1")
            elif self.num_tokens != self.num_reqs * self.query_len:
                problems.append(
                    f"a uniform key has num_tokens == num_reqs * query_len, got "
                    f"{self.num_tokens} != {self.num_reqs} * {self.query_len}"
                )
        elif self.query_len != 0:
            problems.append(f"a mixed key has query_len 0, got {self.query_len}")
        if problems:
            raise ConfigError("invalid BatchKey: " + "; ".join(problems))

    @classmethod
    def decode(cls, num_reqs: int, query_len: int = 1) -> BatchKey:
        """A uniform batch: ``num_reqs`` requests of ``query_len`` tokens each."""
        return cls(num_reqs * query_len, num_reqs, True, query_len)

    @classmethod
    def mixed(cls, num_tokens: int, num_reqs: int | None = None) -> BatchKey:
        """A batch whose requests have different query lengths (prefill chunks + decodes)."""
        return cls(num_tokens, num_reqs, False, 0)

    def relax(self) -> BatchKey | None:
        """The next key in the fallback order, or None when only eager remains.

        A uniform or mixed key relaxes to the tokens-only key (what PIECEWISE graphs
        are keyed by); a tokens-only key does not relax further.
        """
        if self.uniform or self.num_reqs is not None:
            return BatchKey(self.num_tokens)
        return None

    def relaxations(self) -> tuple[BatchKey, ...]:
        """This key followed by every relaxation, in fallback order."""
        out: list[BatchKey] = []
        key: BatchKey | None = self
        while key is not None:
            out.append(key)
            key = key.relax()
        return tuple(out)

    def __str__(self) -> str:
        if self.uniform:
            return f"decode(reqs={self.num_reqs}, q={self.query_len}, tokens={self.num_tokens})"
        if self.num_reqs is not None:
            return f"mixed(tokens={self.num_tokens}, reqs={self.num_reqs})"
        return f"tokens({self.num_tokens})"


@dataclass(frozen=True)
class Decision:
    """What runs a batch: the mode, the key it was padded to, and why.

    ``kind`` is ``Mode.FULL``, ``Mode.PIECEWISE`` or ``Mode.NONE`` (run eagerly); a
    ``Mode`` equals its value, so ``kind == "none"`` works too.
    """

    kind: Mode
    padded_key: BatchKey
    """For FULL/PIECEWISE the captured key replayed; for NONE the batch itself."""
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
        return {
            "keys": self.keys,
            "num_tokens": [self.first, self.last],
            "step": self.step,
            "kind": self.kind.value,
            "sizes": list(self.sizes),
            "reason": self.reason,
            "downgrade": self.downgrade,
        }


__all__ = ["BatchKey", "Decision", "PlanRow"]
