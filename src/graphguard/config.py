"""Execution modes: which batches run as graphs, and how.

* ``NONE`` -- everything eager through the same API (a baseline and a kill switch).
* ``FULL`` -- one CUDA graph per captured size for the whole callable.
* ``PIECEWISE`` -- graphs for everything between split ops (e.g. attention), the split
  ops eager; for batches whose attention does not graph well (ragged prefills).
* ``FULL_AND_PIECEWISE`` -- FULL for uniform-decode batches, PIECEWISE for mixed ones.
"""

from __future__ import annotations

import enum

from graphguard.errors import ConfigError


class Mode(enum.Enum):
    """How a runner executes a batch."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        """Accept a Mode or its name in any case (``"full"``, ``"FULL_AND_PIECEWISE"``)."""
        if isinstance(value, Mode):
            return value
        key = str(value).strip().lower().replace("-", "_")
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
