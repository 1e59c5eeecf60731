"""Capture sizes: the default ladder, validation, and the O(1) padding table.

A graph exists only for the sizes captured; every other batch size pads up to the
next captured size. The ladder trades capture time and memory against padding waste:
dense where padding would double the work (1, 2, 4), a step of 8 up to 256 where
decode batches usually live, then 16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

from graphguard.errors import ConfigError

Hook = Callable[[Sequence[int]], Any]
"""A ``before_capture`` / ``after_capture`` hook, called with the ladder's sizes (here,
the lowest module both the runner options and the capture lifecycle import)."""
MAX_SIZE = 2**24
"""The largest size graphguard builds a padding table for (16,777,216 rows or tokens).

Why a bound: the padding table and the runner's per-batch entries are one slot per
batch size, and the default ladder has one graph per 16 sizes; ``capture_sizes(2**40)``
was a ``MemoryError``. No step batches more rows than this on one device.
"""


def _above_max(what: str, n: int) -> ConfigError:
    return ConfigError(
        f"{what}={n} is above {MAX_SIZE} (graphguard.sizes.MAX_SIZE), the largest size a "
        "padding table holds (one slot per batch size); pass the largest batch or token "
        "count one step really runs, e.g. capture_sizes(512)"
    )


def capture_sizes(max_size: int, *, multiple_of: int = 1) -> list[int]:
    """The default capture ladder up to ``max_size``, ascending, always ending at it.

    ``[1, 2, 4] + range(8, 257, 8) + range(272, max_size + 1, 16)`` truncated at
    ``max_size``, plus ``max_size`` itself. For ``max_size=512`` that is 51 sizes.

    ``multiple_of=q`` (speculative decode with ``q = 1 + k`` tokens per request) gives
    the ladder for ``max_size // q`` requests scaled by ``q``, so every size is a whole
    number of requests.
    """
    if not is_int(max_size) or max_size < 1:
        raise ConfigError(f"capture_sizes: max_size must be a positive int, got {max_size!r}")
    if not is_int(multiple_of) or multiple_of < 1:
        raise ConfigError(f"capture_sizes: multiple_of must be a positive int, got {multiple_of!r}")
    if max_size > MAX_SIZE:
        raise _above_max("capture_sizes: max_size", max_size)
    requests = max_size // multiple_of
    if requests < 1:
        raise ConfigError(
            f"capture_sizes: max_size={max_size} is smaller than multiple_of={multiple_of}; "
            "no whole request fits"
        )
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, requests + 1, 16)]
    out = sorted({s for s in ladder if s <= requests} | {requests})
    return [s * multiple_of for s in out]


def is_int(x: object) -> TypeGuard[int]:
    """Whether ``x`` is an int and not a bool: the one check for a count, size or index.

    Why: ``bool`` subclasses ``int``, so ``isinstance(True, int)`` holds and a flag passed
    where a size belongs (``replay(True)``, ``reserve(True)``) would quietly mean 1.
    """
    return isinstance(x, int) and not isinstance(x, bool)


def validate_sizes(sizes: Iterable[int], *, what: str = "sizes") -> tuple[int, ...]:
    """Check user-given capture sizes and return them ascending.

    Raises :class:`ConfigError` naming every offending entry (non-int, non-positive,
    duplicate) instead of the first only. Linear in the number of sizes (a ladder up to
    a million tokens has ~62,500).
    """
    if isinstance(sizes, (int, float, str, bytes)) or not isinstance(sizes, Iterable):
        alone = f"{what}=[{sizes!r}] for that size alone, or " if is_int(sizes) else ""
        raise ConfigError(
            f"{what} must be a list of ints, got {type(sizes).__name__} {sizes!r:.60}; e.g. "
            f"{alone}graphguard.capture_sizes(max_batch)"
        )
    values = list(sizes)
    problems: list[str] = []
    if not values:
        problems.append("the list is empty")
    bad = 0
    for i, s in enumerate(values):
        if bad >= 5:
            break
        if not is_int(s):
            problems.append(f"entry {i} is {s!r} ({type(s).__name__}), not an int")
            bad += 1
        elif s < 1:
            problems.append(f"entry {i} is {s}, not positive")
            bad += 1
    ints = [s for s in values if is_int(s)]
    seen: set[int] = set()
    dups: set[int] = set()
    for s in ints:
        if s in seen:
            dups.add(s)
        seen.add(s)
    if dups:
        problems.append(f"duplicates {sorted(dups)[:10]}")
    if problems:
        raise ConfigError(
            f"invalid capture {what}: " + "; ".join(problems) + ". Pass distinct positive ints, "
            "e.g. graphguard.capture_sizes(max_batch)."
        )
    return tuple(sorted(ints))


def validate_sample_sizes(
    sample: Iterable[int] | None, ladder: Sequence[int]
) -> tuple[int, ...] | None:
    """Check ``estimate_graph_memory(sample_sizes=...)``: valid sizes, all on the ladder;
    returns them (ascending; a generator is read once, here), or None.

    A sample size the runner would never capture measures a graph that never exists.
    """
    if sample is None:
        return None
    values = validate_sizes(sample, what="sample_sizes")
    on = set(ladder)
    off = [s for s in values if s not in on]
    if off:
        raise ConfigError(
            f"sample_sizes {off} are not capture sizes of this runner (its ladder is "
            f"{list(ladder) if len(ladder) <= 12 else f'{min(ladder)}..{max(ladder)}'}); "
            "sample sizes from runner.sizes, or leave sample_sizes=None"
        )
    return values


def resolve_sizes(
    sizes: Iterable[int] | None, max_size: int | None, example_batch: int
) -> tuple[int, ...]:
    """A runner's capture sizes: the given ones validated, else the default ladder up to
    ``max_size`` (default: the example inputs' batch size)."""
    if sizes is None and max_size is None and example_batch < 1:
        raise ConfigError(
            f"sizes: none given, so the ladder would go up to the example inputs' batch size, "
            f"which is {example_batch}. Pass sizes=[...] (e.g. graphguard.capture_sizes(64)) "
            "or options=graphguard.CaptureOptions(max_size=N), or example inputs with at least "
            "one row."
        )
    if sizes is None:
        sizes = capture_sizes(max_size if max_size is not None else example_batch)
    return validate_sizes(sizes)


class PaddingTable:
    """Maps a batch size to the captured size it pads to, by one list index.

    ``table[n]`` is the smallest captured size ``>= n``; sizes above the largest
    captured size are not in the table (callers run those eagerly).
    """

    __slots__ = ("_table", "sizes")

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes: tuple[int, ...] = tuple(sorted(sizes))
        if self.sizes and self.sizes[-1] > MAX_SIZE:
            raise _above_max("the largest capture size", self.sizes[-1])
        table: list[int | None] = [None]
        for s in self.sizes:  # one slice per size: linear, no per-n Python loop
            table.extend([s] * (s + 1 - len(table)))
        self._table = table

    @property
    def max_size(self) -> int:
        """The largest captured size (0 when nothing is captured)."""
        return self.sizes[-1] if self.sizes else 0

    def padded(self, n: int) -> int | None:
        """The captured size ``n`` pads to, or None when ``n`` is above the largest (or < 1)."""
        if n < 1 or n >= len(self._table):
            return None
        return self._table[n]

    def __repr__(self) -> str:
        return f"PaddingTable(sizes={list(self.sizes)})"


__all__ = [
    "MAX_SIZE",
    "PaddingTable",
    "capture_sizes",
    "is_int",
    "resolve_sizes",
    "validate_sample_sizes",
    "validate_sizes",
]
