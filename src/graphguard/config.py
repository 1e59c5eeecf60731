"""Execution modes and the capture options every runner shares.

* ``NONE`` -- everything eager through the same API (a baseline and a kill switch).
* ``FULL`` -- one CUDA graph per captured size for the whole callable.
* ``PIECEWISE`` -- graphs for everything between split ops (e.g. attention), the split
  ops eager; for batches whose attention does not graph well (ragged prefills).
* ``FULL_AND_PIECEWISE`` -- FULL for uniform-decode batches, PIECEWISE for mixed ones.

:class:`CaptureOptions` holds what the caller *set* of the arguments every runner shares;
a field left ``None`` means "the runner's default". Each runner resolves it once
(:meth:`CaptureOptions.resolved`) into ``runner.options``, so a wrapper
(``DistributedGraphRunner``, the dispatcher, ``GraphedCausalLM``) supplies its own
defaults without ever overriding a value the caller passed. The runner kind (``mode``)
and the kind-specific arguments (``compile``, ``split_ops``, ...) are runner keywords, not
options, so one options object serves every runner.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch

from graphguard.errors import ConfigError
from graphguard.sizes import Hook, validate_sizes

FillValue = int | float | bool


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


# ----------------------------------------------------------------- checks of one value


def _type_name(x: object) -> str:
    return "a function" if callable(x) and not isinstance(x, type) else type(x).__name__


def check_flag(name: str, value: object) -> None:
    """A flag is ``True`` or ``False``: ``"false"`` or ``0`` would read as something else."""
    if not isinstance(value, bool):
        raise ConfigError(
            f"{name} must be True or False, got {_type_name(value)} {value!r:.60}"
            + (
                f"; a string is not a flag (pass {name}={value.strip().lower() in _TRUE})"
                if isinstance(value, str)
                else ""
            )
        )


def _check_list(name: str, value: Any, item: str, ok: Callable[[Any], bool]) -> None:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{name} must be a list of {item}s, got {_type_name(value)} {value!r:.60}; pass "
            f"{name}=[...] (e.g. {name}=[x] for one)"
        )
    for i, v in enumerate(value):
        if not ok(v):
            raise ConfigError(
                f"{name}[{i}] is {_type_name(v)} {v!r:.60}, not a {item}; pass {name}=[{item}, ...]"
            )


def _one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ConfigError(f"{name} must be {listed}, got {_type_name(value)} {value!r:.60}")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
SANITIZE_ENV = "GRAPHGUARD_SANITIZE"
"""The environment switch of the sanitizer: ``1``/``true``/``yes``/``on`` turn it on,
``0``/``false``/``no``/``off`` or unset leave it off (any case); anything else is a
:class:`ConfigError`, so a typo never decides silently."""


def sanitize_enabled(flag: bool | None) -> bool:
    """The sanitize switch: an explicit flag wins, else :data:`SANITIZE_ENV`."""
    if flag is not None:
        check_flag("sanitize", flag)
        return flag
    raw = os.environ.get(SANITIZE_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{SANITIZE_ENV}={raw!r} is neither on ({', '.join(_TRUE)}) nor off "
        f"({', '.join(repr(v) for v in _FALSE)}); set one of those, or pass sanitize= to the runner"
    )


# ------------------------------------------------------------------------- the options

_Opt = TypeVar("_Opt", bound="CaptureOptions")


class KeywordsChecked(type):
    """Turns a misspelt keyword into a :class:`ConfigError` that says "did you mean".

    Python's own ``TypeError: unexpected keyword argument`` names neither the closest
    argument nor the list; the check runs at construction only (mypy still checks the
    call against ``__init__``, since this returns ``Any``).
    """

    def _named_init(cls) -> Callable[..., Any] | None:
        """The first ``__init__`` in the MRO that names its keywords (a mixin's
        ``*args, **kwargs`` passes them on)."""
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None and not any(
                p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()
            ):
                return init  # type: ignore[no-any-return]
        return None

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        init = cls._named_init()
        if init is not None:
            params = inspect.signature(init).parameters
            unknown = [k for k in kwargs if k not in params]
            if unknown:
                kw_only = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
                known = kw_only or [n for n in params if n != "self"]
                raise ConfigError(unknown_message(cls.__name__, unknown, known))
        return super().__call__(*args, **kwargs)

    @property
    def __signature__(cls) -> inspect.Signature:
        """What ``inspect.signature(cls)`` and ``help()`` show: the named ``__init__``."""
        init = cls._named_init()
        if init is None:
            return inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
        sig = inspect.signature(init)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


def unknown_message(where: str, unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unknown argument 'sizess' (did you mean 'sizes'?)`` with the list of arguments."""
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"{where}: unknown argument(s) {', '.join(hints)}; the arguments are "
        f"{', '.join(sorted(known))}"
    )


@dataclass(frozen=True)
class CaptureOptions(metaclass=KeywordsChecked):
    """The capture arguments every runner shares, as the caller set them.

    A field left ``None`` takes the runner's default (listed on each field); a runner
    keeps the resolved copy as ``runner.options``. Pass one object as ``options=`` to
    :class:`~graphguard.GraphRunner`, :class:`~graphguard.PiecewiseRunner`,
    :class:`~graphguard.DistributedGraphRunner`, :func:`~graphguard.build_dispatcher`
    and ``GraphedCausalLM``; keywords given beside it win over its fields. Validated at
    construction: each :class:`ConfigError` names the field, what it got and the fix.
    """

    sizes: Sequence[int] | None = None
    """Capture sizes (any order, distinct, positive). Default ``capture_sizes(max_size)``."""
    max_size: int | None = None
    """The largest batch to capture when ``sizes`` is not given (default: the example
    inputs' batch size). Giving both is an error: the ladder would ignore one."""
    batch_dims: int | Sequence[int] | None = None
    """The batch dimension of each input (one int for all, or one per input). Default 0."""
    fill_values: FillValue | Sequence[FillValue] | None = None
    """What padded rows hold, per input (one for all): make them harmless (token 0, a
    scratch KV slot). Static buffers hold these during warmup and capture too. Default 0."""
    names: Sequence[str] | None = None
    """Input names for error messages. Default ``input 0``, ``input 1``, ..."""
    warmup_iters: int | None = None
    """Uncaptured forwards per size before its capture, each followed by a device
    synchronize. Default 1; 0 skips them (nothing then detects in-place input writes)."""
    before_capture: Sequence[Hook] | None = None
    """Hooks ``hook(sizes)`` run in phase WARMUP before the first capture: kernel warmups
    at realistic shapes, so workspaces reach their final size. Default none."""
    after_capture: Sequence[Hook] | None = None
    """Hooks ``hook(sizes)`` run once every graph exists. Default none."""
    workspaces: Sequence[Any] | None = None
    """:class:`~graphguard.Workspace` arenas to lock after capture. Default none."""
    state: Any = None
    """Tensors the step writes that capture and verify restore: a tensor, a list or dict
    of tensors, a module's buffers (:class:`~graphguard.StateSet`). ``None``: nothing
    declared (capture warns when it sees the step write tensors); ``[]``: the step writes
    nothing that must survive capture (the warning is off)."""
    copy_outputs: bool | None = None
    """Return owned clones instead of views into graph memory. Default False."""
    share_outputs: bool | None = None
    """GraphRunner: each graph's output blocks go back to the pool after its capture, so
    the ladder's pool is about its largest graph's alone (default True); False: every
    graph owns its outputs. Pieces always share."""
    capture_error_mode: str | None = None
    """Passed to ``CUDAGraph.capture_begin``: ``"global"`` (default; with ``lazy``,
    ``"thread_local"``: see :mod:`graphguard.lazy`),
    ``"thread_local"`` (DistributedGraphRunner's default) or ``"relaxed"``."""
    on_capture_error: str | None = None
    """``"raise"`` (default: stop at the first failing size, keep the graphs that exist,
    raise :class:`~graphguard.errors.GraphCaptureError`) or ``"skip"`` (log it, capture the
    remaining sizes)."""
    progress: bool | None = None
    """Show a tqdm bar while capturing. Default True (rank 0 only under TP)."""
    name: str | None = None
    """Shown in logs, the progress bar and errors. Default: the callable's name."""
    sanitize: bool | None = None
    """GraphRunner: turn the sanitizer on (:mod:`graphguard.sanitizer`). Default: the
    ``GRAPHGUARD_SANITIZE`` environment variable (:data:`SANITIZE_ENV`)."""
    generators: Sequence[torch.Generator] | None = None
    """``torch.Generator``s the step draws from, registered with every graph, besides the
    default generator and those reachable from the callable (:mod:`graphguard.rng`).
    Default none."""
    weights: Any = dataclasses.field(default=None, repr=False)
    """The ``nn.Module`` whose parameters and buffers ``update_weights()`` and
    ``check_weights()`` cover, named as it names them. Default: the callable if it is a
    module, the module a bound method belongs to, or the one module it reaches."""
    canary: Any = None
    """A :class:`~graphguard.canary.Canary`: every N-th call of each batch size is also
    run eagerly from the same state and compared (:mod:`graphguard.canary`). Default none."""
    lazy: bool | None = None
    """Capture each size on first use (:mod:`graphguard.lazy`): ``capture()`` runs the
    before-capture stage only (hooks, the two largest sizes' forwards, a compile) and
    locks the arenas; the first call that pads to a size not yet captured captures it
    with the whole lifecycle, then replays it. Default False (the whole ladder at once)."""
    capture_now: Sequence[int] | None = None
    """With ``lazy``: sizes of the ladder ``capture()`` captures up front anyway (the
    sizes traffic is known to hit first). Default none."""
    graph_memory_budget: int | None = None
    """With ``lazy``: the most device memory, in bytes, the runner's graphs may hold:
    the pool plus the driver's share outside the allocator. A lazy capture predicted to
    exceed it does not happen (that size runs eagerly, logged once with the numbers).
    Default: no budget."""

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalize once, here
        if self.sizes is not None:
            fix(self, "sizes", validate_sizes(self.sizes))
        m = self.max_size
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(
                f"max_size must be a positive int, got {type(m).__name__} {m!r}; e.g. "
                "max_size=256 (the largest batch to capture)"
            )
        if self.sizes is not None and m is not None:
            raise ConfigError(
                f"sizes={list(self.sizes)} and max_size={m} were both given, and a ladder "
                f"has one source: pass sizes=[...] alone, or max_size={m} alone for "
                f"graphguard.capture_sizes({m})"
            )
        w = self.warmup_iters
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ConfigError(
                f"warmup_iters must be an int >= 0, got {type(w).__name__} {w!r}; e.g. "
                "warmup_iters=2"
            )
        for hooks_name in ("before_capture", "after_capture"):
            hooks = getattr(self, hooks_name)
            if hooks is not None:
                _check_list(hooks_name, hooks, "hook", callable)
                fix(self, hooks_name, tuple(hooks))
        if self.workspaces is not None:
            _check_list(
                "workspaces",
                self.workspaces,
                "Workspace",
                lambda w: (
                    callable(getattr(w, "lock", None)) and callable(getattr(w, "unlock", None))
                ),
            )
            fix(self, "workspaces", tuple(self.workspaces))
        if self.generators is not None:
            _check_list(
                "generators",
                self.generators,
                "torch.Generator",
                lambda g: isinstance(g, torch.Generator),
            )
            fix(self, "generators", tuple(self.generators))
        for flag in ("copy_outputs", "share_outputs", "progress", "sanitize", "lazy"):
            if getattr(self, flag) is not None:
                check_flag(flag, getattr(self, flag))
        now = self.capture_now
        if now is not None:
            empty = isinstance(now, (list, tuple)) and not now
            fix(self, "capture_now", () if empty else validate_sizes(now, what="capture_now"))
        b = self.graph_memory_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ConfigError(
                f"graph_memory_budget must be a positive int (bytes), got {type(b).__name__} "
                f"{b!r:.60}; e.g. graph_memory_budget=2 << 30 for 2 GiB"
            )
        if self.on_capture_error is not None:
            _one_of("on_capture_error", self.on_capture_error, ("raise", "skip"))
        if self.capture_error_mode is not None:
            _one_of(
                "capture_error_mode",
                self.capture_error_mode,
                ("global", "thread_local", "relaxed"),
            )
        if self.canary is not None:
            from graphguard.canary import Canary  # it imports verify, which imports this

            if not isinstance(self.canary, Canary):
                raise ConfigError(
                    f"canary must be a graphguard.Canary, got {_type_name(self.canary)} "
                    f"{self.canary!r:.60}; e.g. canary=graphguard.Canary(every=1000)"
                )
        if self.name is not None and not isinstance(self.name, str):
            raise ConfigError(
                f"name must be a string, got {type(self.name).__name__} {self.name!r}"
            )
        if self.names is not None and (
            isinstance(self.names, str)
            or not isinstance(self.names, Sequence)
            or not all(isinstance(n, str) for n in self.names)
        ):
            example = f"[{self.names!r}]" if isinstance(self.names, str) else "['tokens', 'pos']"
            raise ConfigError(
                f"names must be a list of strings, one per input, got {self.names!r:.80}; "
                f"e.g. names={example}"
            )

    @classmethod
    def merge(
        cls, options: CaptureOptions | None, *, where: str = "runner", **given: Any
    ) -> CaptureOptions:
        """``options`` (default: nothing set) with every keyword the caller gave that is
        not ``None`` applied; an unknown name is a :class:`ConfigError` naming the
        closest field."""
        if options is not None and not isinstance(options, CaptureOptions):
            raise ConfigError(
                f"options must be a graphguard.CaptureOptions, got {type(options).__name__} "
                f"{options!r:.60}; e.g. options=graphguard.CaptureOptions(sizes=[1, 2, 4])"
            )
        fields = OPTION_NAMES
        unknown = [k for k in given if k not in fields]
        if unknown:
            raise ConfigError(unknown_message(where, unknown, fields))
        set_here = {k: v for k, v in given.items() if v is not None}
        if options is None:
            return cls(**set_here)
        return dataclasses.replace(options, **set_here) if set_here else options

    def resolved(self: _Opt, **defaults: Any) -> _Opt:
        """A copy with each field still ``None`` set to ``defaults[field]`` (a wrapper's
        defaults first, then :data:`DEFAULTS`); fields the caller set stay as they are."""
        # A lazy capture runs while other threads serve: "global" would fail their CUDA work.
        lazy = {"capture_error_mode": "thread_local"} if self.lazy else {}
        fill = {
            k: v
            for k, v in {**DEFAULTS, **lazy, **defaults}.items()
            if getattr(self, k) is None and v is not None
        }
        return dataclasses.replace(self, **fill) if fill else self

    def explicit(self) -> dict[str, Any]:
        """The fields the caller set (not ``None``), for passing on to another runner."""
        return {f: getattr(self, f) for f in OPTION_NAMES if getattr(self, f) is not None}


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CaptureOptions))

DEFAULTS: dict[str, Any] = {
    "batch_dims": 0,
    "fill_values": 0,
    "warmup_iters": 1,
    "before_capture": (),
    "after_capture": (),
    "workspaces": (),
    "copy_outputs": False,
    "share_outputs": True,
    "capture_error_mode": "global",
    "on_capture_error": "raise",
    "progress": True,
    "generators": (),
    "lazy": False,
    "capture_now": (),
}
"""The runner defaults of the options that have one (``sizes``, ``max_size``, ``names``,
``state``, ``name`` and ``sanitize`` are resolved from the inputs, the callable and the
environment instead)."""


class CaptureKwargs(TypedDict, total=False):
    """The :class:`CaptureOptions` fields as keyword arguments of every runner.

    Typed once here (``**kwargs: Unpack[CaptureKwargs]``), so mypy and IDEs check each
    keyword at the call site; the meaning of each is on :class:`CaptureOptions`.
    """

    sizes: Sequence[int] | None
    max_size: int | None
    batch_dims: int | Sequence[int] | None
    fill_values: FillValue | Sequence[FillValue] | None
    names: Sequence[str] | None
    warmup_iters: int | None
    before_capture: Sequence[Hook] | None
    after_capture: Sequence[Hook] | None
    workspaces: Sequence[Any] | None
    state: Any
    copy_outputs: bool | None
    share_outputs: bool | None
    capture_error_mode: str | None
    on_capture_error: str | None
    progress: bool | None
    name: str | None
    sanitize: bool | None
    generators: Sequence[torch.Generator] | None
    weights: Any
    canary: Any
    lazy: bool | None
    capture_now: Sequence[int] | None
    graph_memory_budget: int | None


_F = TypeVar("_F", bound=Callable[..., Any])


def option_keywords(func: _F) -> _F:
    """Show the option keywords in ``help()`` and ``inspect.signature``.

    ``**kwargs: Unpack[CaptureKwargs]`` is what type checkers read; this replaces it in
    the runtime signature by one keyword-only parameter per option (default ``None``:
    the runner's default), so ``help(GraphRunner)`` lists them too.
    """
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in params}
    hints = {f.name: f.type for f in dataclasses.fields(CaptureOptions)}
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[n])
        for n in OPTION_NAMES
        if n not in taken
    ]
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return func


__all__ = [
    "DEFAULTS",
    "OPTION_NAMES",
    "SANITIZE_ENV",
    "CaptureKwargs",
    "CaptureOptions",
    "FillValue",
    "Hook",
    "KeywordsChecked",
    "Mode",
    "check_flag",
    "option_keywords",
    "sanitize_enabled",
    "unknown_message",
]
