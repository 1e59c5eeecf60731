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


def validate_capture_options(
    *, warmup_iters: int, on_capture_error: str, capture_error_mode: str
) -> None:
    """The checks every runner makes of its capture options, with one set of messages."""
    if warmup_iters < 0:
        raise ConfigError(f"warmup_iters must be >= 0, got {warmup_iters}")
    if on_capture_error not in ("raise", "skip"):
        raise ConfigError(f"on_capture_error must be 'raise' or 'skip', got {on_capture_error!r}")
    if capture_error_mode not in ("global", "thread_local", "relaxed"):
        raise ConfigError(
            "capture_error_mode must be 'global', 'thread_local' or 'relaxed', got "
            f"{capture_error_mode!r}"
        )


__all__ = ["Mode", "validate_capture_options"]
