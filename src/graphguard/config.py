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
from graphguard.sizes import Hook, validate_sizes


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


_UNSET: Any = object()


def _type_name(x: object) -> str:
    return "a function" if callable(x) and not isinstance(x, type) else type(x).__name__


def _check_list(name: str, value: Any, item: str, ok: Callable[[Any], bool]) -> None:
    if value is None or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{name} must be a list of {item}s, got {_type_name(value)} {value!r:.60}; pass "
            f"{name}=[...] (e.g. {name}=[x] for one)"
        )
    for i, v in enumerate(value):
        if not ok(v):
            raise ConfigError(
                f"{name}[{i}] is {_type_name(v)} {v!r:.60}, not a {item}; pass {name}=[{item}, ...]"
            )


def validate_capture_options(
    *,
    warmup_iters: Any = _UNSET,
    on_capture_error: Any = _UNSET,
    capture_error_mode: Any = _UNSET,
    before_capture: Any = _UNSET,
    after_capture: Any = _UNSET,
    workspaces: Any = _UNSET,
    copy_outputs: Any = _UNSET,
    share_outputs: Any = _UNSET,
    progress: Any = _UNSET,
    compile: Any = _UNSET,
    mode: Any = _UNSET,
    name: Any = _UNSET,
) -> None:
    """The checks every runner makes of its capture options, with one set of messages.

    Keyword-only; pass what the caller has (every argument is optional). Each
    :class:`ConfigError` names the argument, what it got and the fix.

    ``warmup_iters=0`` is allowed: with no uncaptured warmup nothing can detect a callable
    that writes its inputs in place, so the runner refills padded rows on every call, and
    no undeclared state is reported (declare it with ``state=``).
    """
    if warmup_iters is not _UNSET and (
        not isinstance(warmup_iters, int) or isinstance(warmup_iters, bool) or warmup_iters < 0
    ):
        raise ConfigError(
            f"warmup_iters must be an int >= 0, got {type(warmup_iters).__name__} "
            f"{warmup_iters!r}; e.g. warmup_iters=2"
        )
    if on_capture_error is not _UNSET and on_capture_error not in ("raise", "skip"):
        raise ConfigError(f"on_capture_error must be 'raise' or 'skip', got {on_capture_error!r}")
    if capture_error_mode is not _UNSET and capture_error_mode not in (
        "global",
        "thread_local",
        "relaxed",
    ):
        raise ConfigError(
            "capture_error_mode must be 'global', 'thread_local' or 'relaxed', got "
            f"{capture_error_mode!r}"
        )
    for hooks_name, hooks in (("before_capture", before_capture), ("after_capture", after_capture)):
        if hooks is not _UNSET:
            _check_list(hooks_name, hooks, "hook", callable)
    if workspaces is not _UNSET:
        _check_list(
            "workspaces",
            workspaces,
            "Workspace",
            lambda w: callable(getattr(w, "lock", None)) and callable(getattr(w, "unlock", None)),
        )
    for flag_name, flag in (
        ("copy_outputs", copy_outputs),
        ("share_outputs", share_outputs),
        ("progress", progress),
        ("compile", compile),
    ):
        if flag is not _UNSET and not isinstance(flag, bool):
            raise ConfigError(
                f"{flag_name} must be True or False, got {type(flag).__name__} {flag!r}"
            )
    if mode is not _UNSET:
        Mode.parse(mode)
    if name is not _UNSET and name is not None and not isinstance(name, str):
        raise ConfigError(f"name must be a string, got {type(name).__name__} {name!r}")


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
    compile: bool = False
    """GraphRunner: capture an Inductor-compiled step, compiled once for the whole ladder
    (:mod:`graphguard.compiled`)."""

    def __post_init__(self) -> None:
        validate_capture_options(
            warmup_iters=self.warmup_iters,
            on_capture_error=self.on_capture_error,
            capture_error_mode=self.capture_error_mode,
            before_capture=self.before_capture,
            after_capture=self.after_capture,
            workspaces=self.workspaces,
            copy_outputs=self.copy_outputs,
            share_outputs=self.share_outputs,
            progress=self.progress,
            compile=self.compile,
            mode=self.mode,
            name=self.name,
        )
        fix = object.__setattr__  # frozen: normalize once, here
        fix(self, "mode", Mode.parse(self.mode))
        if self.sizes is not None:
            fix(self, "sizes", validate_sizes(self.sizes))
        if self.max_size is not None:
            m = self.max_size
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ConfigError(
                    f"max_size must be a positive int, got {type(m).__name__} {m!r}; e.g. "
                    "max_size=256 (the largest batch to capture)"
                )
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
