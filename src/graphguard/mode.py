"""The execution modes of a runner (:class:`Mode`).

* ``NONE`` -- everything eager through the same API (a baseline and a kill switch).
* ``FULL`` -- one CUDA graph per captured size for the whole callable.
* ``PIECEWISE`` -- graphs for everything between split ops (e.g. attention), the split
  ops eager; for batches whose attention does not graph well (ragged prefills).
* ``FULL_AND_PIECEWISE`` -- FULL for uniform-decode batches, PIECEWISE for mixed ones.
"""

from __future__ import annotations

import enum

from graphguard.errors import ConfigError


class Mode(str, enum.Enum):
    """How a runner executes a batch, and what runs one batch (``Decision.kind``).

    A ``str`` enum: ``Mode.FULL == "full"``, and it prints, hashes and serializes as its
    value, so plans and reports can use it as a plain key.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        """Accept a Mode or its name in any case (``"full"``, ``"FULL_AND_PIECEWISE"``)."""
        if isinstance(value, Mode):
            return value
        if not isinstance(value, str):
            raise ConfigError(
                f"mode must be a graphguard.Mode or its name, got {type(value).__name__} "
                f"{value!r}; pass mode='full' for graphs or mode='none' to run eagerly"
            )
        key = value.strip().lower().replace("-", "_")
        for m in cls:
            if m.value == key:
                return m
        raise ConfigError(
            f"unknown mode {value!r}; choose one of {', '.join(m.value for m in cls)}"
        )

    @property
    def has_full(self) -> bool:
        """Whether this mode captures whole-callable graphs."""
        return self in (Mode.FULL, Mode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        """Whether this mode captures piecewise graphs."""
        return self in (Mode.PIECEWISE, Mode.FULL_AND_PIECEWISE)


__all__ = ["Mode"]
