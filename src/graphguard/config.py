"""Execution modes and the capture options every runner shares.

* ``NONE`` -- everything eager through the same API (a baseline and a kill switch).
* ``FULL`` -- one CUDA graph per captured size for the whole callable.
* ``PIECEWISE`` -- graphs for everything between split ops (e.g. attention), the split
  ops eager; for batches whose attention does not graph well (ragged prefills).
* ``FULL_AND_PIECEWISE`` -- FULL for uniform-decode batches, PIECEWISE for mixed ones.

:class:`CaptureOptions` holds the arguments common to every runner under one name each;
the runners build it from their keyword arguments and validate it once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
                f"mode must be a graphguard.Mode or its name, got {value!r} "
                f"({type(value).__name__}); choose one of {', '.join(m.value for m in cls)}"
            )
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


Hook = Callable[[Sequence[int]], Any]
"""A ``before_capture`` / ``after_capture`` hook: called with the capture sizes."""


@dataclass(frozen=True)
class CaptureOptions:
    """The runner arguments common to :class:`~graphguard.GraphRunner`,
    :class:`~graphguard.PiecewiseRunner` and :class:`~graphguard.DistributedGraphRunner`.

    Runners take these as keyword arguments (``GraphRunner(fn, x, sizes=[1, 2, 4])``) and
    build one of these; pass ``options=`` to share one set between runners (keyword
    arguments given beside it override its fields). Validated once, at construction.
    The meaning of each field is documented on :class:`~graphguard.GraphRunner`.

    ``mode`` defaults to FULL here and to PIECEWISE in ``PiecewiseRunner``'s keyword
    arguments; ``mode=None`` is an error, never ``Mode.NONE``.
    """

    sizes: Sequence[int] | None = None
    max_size: int | None = None
    mode: Mode | str = Mode.FULL
    batch_dims: int | Sequence[int] = 0
    fill_values: int | float | bool | Sequence[int | float | bool] = 0
    names: Sequence[str] | None = None
    warmup_iters: int = 1
    before_capture: Sequence[Hook] = ()
    after_capture: Sequence[Hook] = ()
    workspaces: Sequence[Any] = ()
    copy_outputs: bool = False
    share_outputs: bool = True
    capture_error_mode: str = "global"
    on_capture_error: str = "raise"
    progress: bool = True
    name: str | None = None
    sanitize: bool | None = None
    state: Any = None
    """Tensors capture and verify restore (a ``graphguard.state.StateSet``), or None."""

    def __post_init__(self) -> None:
        validate_capture_options(
            warmup_iters=self.warmup_iters,
            on_capture_error=self.on_capture_error,
            capture_error_mode=self.capture_error_mode,
        )
        fix = object.__setattr__  # frozen: normalize once, here
        fix(self, "mode", Mode.parse(self.mode))
        if self.sizes is not None:
            fix(self, "sizes", tuple(self.sizes))
        fix(self, "before_capture", tuple(self.before_capture))
        fix(self, "after_capture", tuple(self.after_capture))
        fix(self, "workspaces", tuple(self.workspaces))

    @classmethod
    def build(cls, options: CaptureOptions | None, kwargs: dict[str, Any]) -> CaptureOptions:
        """``options`` (default: all defaults) with ``kwargs`` applied; unknown names are a
        :class:`ConfigError` naming the closest field."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            import difflib

            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, fields, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"unknown runner argument(s) {', '.join(hints)}; the arguments are "
                f"{', '.join(sorted(fields))}"
            )
        if options is not None and not isinstance(options, CaptureOptions):
            raise ConfigError(
                f"options must be a graphguard.CaptureOptions, got {type(options).__name__}"
            )
        if options is None:
            return cls(**kwargs)
        return dataclasses.replace(options, **kwargs) if kwargs else options

    @property
    def run_mode(self) -> Mode:
        """``mode`` as a :class:`Mode` (it is normalized at construction)."""
        return Mode.parse(self.mode)


__all__ = ["CaptureOptions", "Hook", "Mode", "validate_capture_options"]
