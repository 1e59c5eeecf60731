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
and the kind-specific arguments (``compile``, ``split_ops``, ``share_outputs``,
``sanitize``, ...) are runner keywords, not options, so one options object serves every
runner. The options of one feature are one frozen object declared here, low in the
imports: :class:`Canary` (``canary=``) and :class:`Lazy` (``lazy=``). Each option is
declared once, as a field with its runner default (:meth:`CaptureOptions.defaults`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch

from graphguard.errors import ConfigError
from graphguard.outputs import check_output_dims
from graphguard.report import VerifyReport
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


PROVENANCE_ENV = "GRAPHGUARD_PROVENANCE"
"""The environment switch of graph provenance for runners built with ``provenance=None``
(same values as :data:`SANITIZE_ENV`): a whole test suite or service audited without
touching its code."""


def env_switch(env: str, keyword: str) -> bool:
    """An on/off environment variable; a value that is neither is a :class:`ConfigError`."""
    raw = os.environ.get(env, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{env}={raw!r} is neither on ({', '.join(_TRUE)}) nor off "
        f"({', '.join(repr(v) for v in _FALSE)}); set one of those, or pass {keyword}= to "
        "the runner"
    )


def sanitize_enabled(flag: bool | None) -> bool:
    """The sanitize switch: an explicit flag wins, else :data:`SANITIZE_ENV`."""
    if flag is not None:
        check_flag("sanitize", flag)
        return flag
    return env_switch(SANITIZE_ENV, "sanitize")


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


_WRAPPERS = "DistributedGraphRunner, build_dispatcher and GraphedCausalLM take it too"

MOVED_OPTIONS: dict[str, str] = {
    "capture_now": "capture_now moved into lazy=graphguard.Lazy(capture_now=[...]) in 0.3",
    "graph_memory_budget": (
        "graph_memory_budget moved into lazy=graphguard.Lazy(budget=...) in 0.3 "
        "(bytes, e.g. budget=2 << 30)"
    ),
    "share_outputs": (
        "share_outputs left the options in 0.3: it is a GraphRunner keyword, "
        f"GraphRunner(..., share_outputs=False) ({_WRAPPERS}; PiecewiseRunner's pieces "
        "always share)"
    ),
    "sanitize": (
        "sanitize left the options in 0.3: it is a GraphRunner keyword, "
        f"GraphRunner(..., sanitize=True) ({_WRAPPERS}), or set GRAPHGUARD_SANITIZE=1"
    ),
}
"""Option keywords that 0.3 removed, and what to write instead: every unknown-keyword
error (:func:`unknown_message`) says it."""


def unknown_message(where: str, unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unknown argument 'sizess' (did you mean 'sizes'?)`` with the list of arguments;
    a keyword that moved (:data:`MOVED_OPTIONS`) says where it went instead."""
    moved = [MOVED_OPTIONS[k] for k in unknown if k in MOVED_OPTIONS and k not in known]
    rest = [k for k in unknown if k not in MOVED_OPTIONS or k in known]
    parts = [f"{where}: {m}" for m in moved]
    if rest:
        hints = []
        for k in rest:
            close = difflib.get_close_matches(k, known, n=1)
            field = difflib.get_close_matches(k, [m for m in MOVED_OPTIONS if m not in known], 1)
            if close:
                hints.append(f"{k!r} (did you mean {close[0]!r}?)")
            elif field and field[0] in OPTION_NAMES:  # an options-only field, misspelt
                hints.append(
                    f"{k!r} (did you mean options=graphguard.CaptureOptions({field[0]}=...)?)"
                )
            else:
                hints.append(f"{k!r}")
        parts.append(
            f"{where}: unknown argument(s) {', '.join(hints)}; the arguments are "
            f"{', '.join(sorted(known))}"
        )
    return "; ".join(parts)


def check_tolerances(where: str, rtol: Any, atol: Any) -> None:
    """``rtol``/``atol`` are numbers >= 0 or None (the per-dtype default); the one check of
    :func:`~graphguard.verify` and :class:`Canary`."""
    for arg, tol in (("rtol", rtol), ("atol", atol)):
        if tol is None:
            continue
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
            raise ConfigError(
                f"{where}({arg}=...) must be a number >= 0 or None (the per-dtype default), "
                f"got {type(tol).__name__} {tol!r:.60}"
            )
        if not math.isfinite(tol) or tol < 0:
            raise ConfigError(
                f"{where}({arg}={tol!r}): a tolerance must be finite and >= 0; e.g. "
                f"{arg}=1e-3, or None for the per-dtype default"
            )


# ------------------------------------------------------- the option objects of a feature

OnDivergence = str | Callable[[VerifyReport], Any]
_DIVERGENCE_MODES = ("warn", "raise", "eager")


@dataclass(frozen=True)
class Canary(metaclass=KeywordsChecked):
    """What the canary checks and what it does on a divergence (``canary=`` option;
    the watch itself is :mod:`graphguard.canary`).

    Args:
        every: check every ``every``-th call of each batch size (1: every call; the
            first check is call ``every``). Default 1000.
        rtol, atol: override the per-dtype tolerance of
            :func:`~graphguard.verify.default_tolerance` (``None``: the default; bf16
            ``2e-2``, replay and eager run the same kernels).
        on_divergence: ``"warn"`` (log the report once per size, keep serving graphs),
            ``"raise"`` (:class:`~graphguard.errors.DivergenceError` with ``.report``),
            ``"eager"`` (this call returns eager's result, and that size is served eagerly
            from then on: correct and slower, said once) or a callable receiving the
            :class:`~graphguard.report.VerifyReport`. Every divergence is counted in
            ``runner.canary_stats()`` whatever the choice.
        poison_padding: during canary checks only, fill the padded rows with NaN (float
            inputs) and the dtype's max (integer inputs) instead of the fill values, so
            real rows that read padded rows diverge instead of passing by luck. ``True``:
            every input; a list of input names: those only (leave out token ids or slot
            indices the step indexes with: an out-of-range index faults on CUDA);
            ``None`` (default): float inputs when the runner has ``sanitize=True``, else
            none; ``False``: never.
        poison_arenas: fill every arena the runner locks (``workspaces=``) with NaN right
            after capture locks it (:meth:`Workspace.poison
            <graphguard.workspace.Workspace.poison>`), so a replay that reads scratch it
            did not write (a row past the ones it wrote, what an earlier call left)
            diverges instead of passing on zeros. Once, at the lock, never while serving.
            ``None`` (default): with ``sanitize=True``; ``True``/``False``: always/never.
            Replay and eager share the arena, so scratch neither writes reads NaN on both
            and compares equal: what shows is a replay reading scratch that eager, run
            right after it, finds written.
    """

    every: int = 1000
    rtol: float | None = None
    atol: float | None = None
    on_divergence: OnDivergence = "warn"
    poison_padding: bool | Sequence[str] | None = None
    poison_arenas: bool | None = None

    def __post_init__(self) -> None:
        n = self.every
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(
                f"Canary(every=...) must be an int >= 1 (check every N-th call of a size), "
                f"got {type(n).__name__} {n!r:.60}; e.g. every=1000"
            )
        check_tolerances("Canary", self.rtol, self.atol)
        how = self.on_divergence
        if not callable(how) and how not in _DIVERGENCE_MODES:
            raise ConfigError(
                f"Canary(on_divergence=...) must be 'warn', 'raise', 'eager' or a callable "
                f"taking the report, got {type(how).__name__} {how!r:.60}"
            )
        p = self.poison_padding
        if p is not None and not isinstance(p, bool):
            if (
                isinstance(p, str)
                or not isinstance(p, Sequence)
                or not all(isinstance(x, str) for x in p)
            ):
                raise ConfigError(
                    f"Canary(poison_padding=...) must be True, False, None or a list of "
                    f"input names, got {type(p).__name__} {p!r:.60}; e.g. "
                    "poison_padding=['hidden']"
                )
            object.__setattr__(self, "poison_padding", tuple(p))
        a = self.poison_arenas
        if a is not None and not isinstance(a, bool):
            raise ConfigError(
                f"Canary(poison_arenas=...) must be True, False or None (on with "
                f"sanitize=True), got {type(a).__name__} {a!r:.60}"
            )


EVICT = (None, "lru")
"""``Lazy(evict=...)``: refuse a size over the budget, or release the least recently
replayed graphs to make room."""


@dataclass(frozen=True)
class Lazy(metaclass=KeywordsChecked):
    """Lazy capture (``lazy=`` option, :mod:`graphguard.lazy`): ``capture()`` runs the
    before-capture stage only, and each size is captured when traffic reaches it: the first
    call at a size runs the step eagerly as that size's warmup and returns its result, the
    next call captures it warm and replays (``docs/lazy.md``).

    ``lazy=True`` is shorthand for ``lazy=Lazy()``.

    Args:
        capture_now: sizes of the ladder ``capture()`` captures up front anyway (the sizes
            traffic is known to hit first). Default none.
        budget: the most device memory, in bytes, the runner's graphs may hold: the pool
            plus the driver's share outside the allocator. A lazy capture predicted to
            exceed it does not happen (that size runs eagerly, logged once with the
            numbers), unless ``evict`` makes room. Default ``None``: no budget.
        warm_shapes: the stage also runs one uncaptured forward at every size of the
            ladder (each followed by a synchronize), so each shape's first-run work --
            cuDNN and cuBLAS plans, kernel selection -- is paid at start-up and a size met
            later costs a warm capture. The trade, measured on the H200 for the reference
            1B step (``bench/results/README.md``): about a warm forward per size added to
            the stage (far more with per-shape cuDNN attention plans), against the
            first-run cost removed from each lazy capture. That forward is also the first
            warmup iteration of the size's lazy capture: it runs ``warmup_iters - 1``
            uncaptured forwards (none with the default 1), then the synchronize that
            follows every warmup, and every other step as before (the idle-stream check,
            the locked arenas, the budget; with no warmup left a CUDA capture runs nothing,
            so the state is not snapshotted or restored: nothing wrote it). Once per stage
            and size (a recapture's stage warms again); not when no ``state=`` is declared,
            since the first warmup is where undeclared writes are watched (declare
            ``state=[]`` when the writes are harmless). ``stats()`` says which sizes:
            ``SizeStats.prewarmed``, ``warmups``, ``phases_ms["warmup"]`` 0.0.
            A stage-warmed size is captured on its first call (no eager first call).
            Default False.
        evict: what a capture that would exceed ``budget`` does. ``None`` (default): it
            does not happen, and the size runs eagerly until ``recapture()``. ``"lru"``:
            the graphs least recently replayed are released until the capture is
            predicted to fit (their driver share back at once; their pool blocks stay in
            the ladder's pool for the next captures, unless the last graph goes and takes
            the pool with it); an evicted size met again is captured again, warm, on that
            call. Needs a ``budget``. ``stats()`` counts evictions and recaptures per size.
    """

    capture_now: Sequence[int] = ()
    budget: int | None = None
    warm_shapes: bool = False
    evict: str | None = None

    def __post_init__(self) -> None:
        now = self.capture_now
        empty = isinstance(now, (list, tuple)) and not now
        fixed = () if empty else validate_sizes(now, what="Lazy(capture_now=...)")
        object.__setattr__(self, "capture_now", fixed)
        b = self.budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ConfigError(
                f"Lazy(budget=...) must be a positive int (bytes) or None (no budget), got "
                f"{type(b).__name__} {b!r:.60}; e.g. budget=2 << 30 for 2 GiB"
            )
        check_flag("Lazy(warm_shapes=...)", self.warm_shapes)
        if self.evict not in EVICT:
            raise ConfigError(
                f"Lazy(evict=...) must be None (refuse a size over the budget) or 'lru' "
                f"(release the least recently replayed graphs), got "
                f"{type(self.evict).__name__} {self.evict!r:.60}"
            )
        if self.evict is not None and b is None:
            raise ConfigError(
                f"Lazy(evict={self.evict!r}) releases graphs to stay within a budget, but "
                "budget is None; give budget=<bytes> (e.g. Lazy(budget=2 << 30, evict='lru'))"
            )

    def check_sizes(self, label: str, sizes: Sequence[int]) -> None:
        """``capture_now`` must be sizes of the ladder ``sizes`` (ascending) of the runner
        ``label``."""
        off = sorted(set(self.capture_now) - set(sizes))
        if off:
            raise ConfigError(
                f"{label}: Lazy(capture_now={off}) are not sizes of the ladder "
                f"({sizes[0]}..{sizes[-1]}, {len(sizes)} sizes); pick them from runner.sizes"
            )


# ------------------------------------------------------------------------- the options


def _opt(default: Any, *, repr: bool = True) -> Any:
    """A field the caller may leave ``None``, which :meth:`CaptureOptions.resolved` fills
    with ``default``: the one place an option's runner default is written."""
    return dataclasses.field(default=None, repr=repr, metadata={"default": default})


@dataclass(frozen=True)
class CaptureOptions(metaclass=KeywordsChecked):
    """The capture arguments every runner shares, as the caller set them.

    A field left ``None`` takes the runner's default (listed on each field,
    :meth:`defaults`); a runner keeps the resolved copy as ``runner.options``. Pass one
    object as ``options=`` to :class:`~graphguard.GraphRunner`,
    :class:`~graphguard.PiecewiseRunner`, :class:`~graphguard.DistributedGraphRunner`,
    :func:`~graphguard.build_dispatcher` and ``GraphedCausalLM``; keywords given beside it
    win over its fields. Validated at construction: each :class:`ConfigError` names the
    field, what it got and the fix. Options of one feature are one object
    (``canary=Canary(...)``, ``lazy=Lazy(...)``); flags only one runner reads are that
    runner's keywords (``GraphRunner(share_outputs=..., sanitize=...)``).
    """

    sizes: Sequence[int] | None = None
    """Capture sizes (any order, distinct, positive). Default ``capture_sizes(max_size)``."""
    max_size: int | None = None
    """The largest batch to capture when ``sizes`` is not given (default: the example
    inputs' batch size). Giving both is an error: the ladder would ignore one."""
    batch_dims: int | Sequence[int] | None = _opt(0)
    """The batch dimension of each input (one int for all, or one per input). Default 0."""
    fill_values: FillValue | Sequence[FillValue] | None = _opt(0)
    """What padded rows hold, per input (one for all): make them harmless (token 0, a
    scratch KV slot). Static buffers hold these during warmup and capture too. Default 0."""
    names: Sequence[str] | None = None
    """Input names for error messages. Default ``input 0``, ``input 1``, ..."""
    warmup_iters: int | None = _opt(1)
    """Uncaptured forwards per size before its capture, each followed by a device
    synchronize. Default 1; 0 skips them (nothing then detects in-place input writes).
    With ``Lazy(warm_shapes=True)`` the stage's forward at a size counts as the first of
    them at its lazy capture (:class:`Lazy`); up front, the output-layout probe's forward
    at each of the two largest sizes does (the first size's not, when no ``state=`` is
    declared: that warmup is watched for undeclared writes)."""
    before_capture: Sequence[Hook] | None = _opt(())
    """Hooks ``hook(sizes)`` run in phase WARMUP before the first capture: kernel warmups
    at realistic shapes, so workspaces reach their final size. Default none."""
    after_capture: Sequence[Hook] | None = _opt(())
    """Hooks ``hook(sizes)`` run once every graph exists. Default none."""
    workspaces: Sequence[Any] | None = _opt(())
    """:class:`~graphguard.Workspace` arenas to lock after capture. Default none."""
    state: Any = None
    """Tensors the step writes that capture and verify restore: a tensor, a list or dict
    of tensors, a module's buffers (:class:`~graphguard.StateSet`). ``None``: nothing
    declared (capture warns when it sees the step write tensors); ``[]``: the step writes
    nothing that must survive capture (the warning is off)."""
    copy_outputs: bool | None = _opt(False)
    """Return owned clones instead of views into graph memory. Default False."""
    capture_error_mode: str | None = _opt("global")
    """Passed to ``CUDAGraph.capture_begin``: ``"global"`` (default; with ``lazy``,
    ``"thread_local"``: see :mod:`graphguard.lazy`),
    ``"thread_local"`` (DistributedGraphRunner's default) or ``"relaxed"``."""
    on_capture_error: str | None = _opt("raise")
    """``"raise"`` (default: stop at the first failing size, keep the graphs that exist,
    raise :class:`~graphguard.errors.GraphCaptureError`) or ``"skip"`` (log it, capture the
    remaining sizes)."""
    progress: bool | None = _opt(True)
    """Show a tqdm bar while capturing. Default True (rank 0 only under TP)."""
    name: str | None = None
    """Shown in logs, the progress bar and errors. Default: the callable's name."""
    generators: Sequence[torch.Generator] | None = _opt(())
    """``torch.Generator``s the step draws from, registered with every graph, besides the
    default generator and those reachable from the callable (:mod:`graphguard.rng`).
    Default none."""
    weights: Any = dataclasses.field(default=None, repr=False)
    """The ``nn.Module`` whose parameters and buffers ``update_weights()`` and
    ``check_weights()`` cover, named as it names them. Default: the callable if it is a
    module, the module a bound method belongs to, or the one module it reaches."""
    canary: Canary | None = None
    """A :class:`Canary`: every N-th call of each batch size is also run eagerly from the
    same state and compared (:mod:`graphguard.canary`). Default none."""
    lazy: Lazy | None = None
    """A :class:`Lazy`: capture each size on first use (:mod:`graphguard.lazy`):
    ``capture()`` runs the before-capture stage only (hooks, the two largest sizes'
    forwards, a compile) and locks the arenas; the first call that pads to a size not yet
    captured captures it with the whole lifecycle, then replays it. ``True`` is shorthand
    for ``Lazy()`` and ``False`` for ``None`` (normalized at construction, so a built
    object holds a ``Lazy`` or ``None``). Default none: the whole ladder at once."""
    output_batch_dims: int | Sequence[int | None] | None = None
    """Which dim of each output leaf is the batch (``None`` for a leaf that is the same
    at every batch size), when the caller knows: one int for every tensor leaf, or one
    entry per leaf in ``torch.utils._pytree`` order. Default ``None``: learned by the
    output-layout probe, the step run uncaptured at the two largest sizes
    (:mod:`graphguard.outputs`). Declared, a lazy runner's stage runs no forward for it
    (only the largest size's, to size ``workspaces`` or compile), so a process serves its
    first request without running the step first; every forward is still checked against
    it and a leaf that does not fit is refused, naming it."""
    provenance: bool | None = None
    """Read every captured graph's kernel arguments and resolve them to owners
    (:mod:`graphguard.provenance`): exact ``graph_reads()``, ``check_weights()`` and the
    refit verdict naming the graphs that read a tensor, ``runner.audit()``; with
    ``sanitize=True`` a graph proven to take a pointer into freed memory is refused at
    capture. Default ``None``: on for CUDA graphs when ``cuda-bindings`` imports
    (``graphguard[cuda]``; else a one-time log line and the module-tree inference), the
    graphs kept and read on the first question; off on the CPU emulation;
    ``GRAPHGUARD_PROVENANCE`` set to on or off decides instead. ``True``: on, the
    emulation's read recording too; ``False``: off everywhere, whatever the environment
    says."""

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
        for flag in ("copy_outputs", "progress", "provenance"):
            if getattr(self, flag) is not None:
                check_flag(flag, getattr(self, flag))
        lazy: object = self.lazy
        if lazy is True:
            fix(self, "lazy", Lazy())
        elif lazy is False:
            fix(self, "lazy", None)
        elif lazy is not None and not isinstance(lazy, Lazy):
            raise ConfigError(
                f"lazy must be a graphguard.Lazy(...), True (Lazy()) or False, got "
                f"{_type_name(lazy)} {lazy!r:.60}; e.g. "
                "lazy=graphguard.Lazy(capture_now=[1, 8], budget=2 << 30)"
            )
        dims = self.output_batch_dims
        if dims is not None:
            fix(self, "output_batch_dims", check_output_dims(dims))
        if self.on_capture_error is not None:
            _one_of("on_capture_error", self.on_capture_error, ("raise", "skip"))
        if self.capture_error_mode is not None:
            _one_of(
                "capture_error_mode",
                self.capture_error_mode,
                ("global", "thread_local", "relaxed"),
            )
        if self.canary is not None and not isinstance(self.canary, Canary):
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
    def defaults(cls) -> dict[str, Any]:
        """The runner default of each option that has one, from its field (``sizes``,
        ``max_size``, ``names``, ``state``, ``name``, ``weights``, ``canary`` and ``lazy``
        are resolved from the inputs and the callable, or stay unset)."""
        return {f.name: f.metadata["default"] for f in _FIELDS if "default" in f.metadata}

    @classmethod
    def merge(
        cls, options: CaptureOptions | None, *, where: str = "runner", **given: Any
    ) -> CaptureOptions:
        """``options`` (default: nothing set) with every keyword the caller gave that is
        not ``None`` applied; an unknown name is a :class:`ConfigError` naming the
        closest field (or, for a name that moved, where it went)."""
        if options is not None and not isinstance(options, CaptureOptions):
            raise ConfigError(
                f"options must be a graphguard.CaptureOptions, got {type(options).__name__} "
                f"{options!r:.60}; e.g. options=graphguard.CaptureOptions(sizes=[1, 2, 4])"
            )
        unknown = [k for k in given if k not in KEYWORD_OPTIONS]
        if unknown:
            raise ConfigError(unknown_message(where, unknown, KEYWORD_OPTIONS))
        set_here = {k: v for k, v in given.items() if v is not None}
        if options is None:
            return cls(**set_here)
        return dataclasses.replace(options, **set_here) if set_here else options

    def resolved(self: _Opt, **defaults: Any) -> _Opt:
        """A copy with each field still ``None`` set to ``defaults[field]`` (a wrapper's
        defaults first, then :meth:`defaults`); fields the caller set stay as they are."""
        # A lazy capture runs while other threads serve: "global" would fail their CUDA work.
        lazy = {"capture_error_mode": "thread_local"} if self.lazy else {}
        fill = {
            k: v
            for k, v in {**self.defaults(), **lazy, **defaults}.items()
            if getattr(self, k) is None and v is not None
        }
        return dataclasses.replace(self, **fill) if fill else self

    def explicit(self) -> dict[str, Any]:
        """The fields the caller set (not ``None``), for passing on to another runner."""
        return {f: getattr(self, f) for f in OPTION_NAMES if getattr(self, f) is not None}


_FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(CaptureOptions)
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in _FIELDS)


class CaptureKwargs(TypedDict, total=False):
    """The :class:`CaptureOptions` fields every runner also takes as keywords.

    The options a user sets on most runners (the ladder, the padding, the warmups, the
    arenas and state, the feature objects). The rest (:data:`OPTIONS_ONLY`) are fields of
    :class:`CaptureOptions` alone, passed as ``options=``: so a runner's signature stays
    small enough to read, as ``torch.cuda.graph`` keeps its own (``help(GraphRunner)``
    lists what it takes). Typed here for ``**kwargs: Unpack[CaptureKwargs]``, so mypy and
    IDEs check each keyword at the call site; the meaning and default of each is on its
    :class:`CaptureOptions` field. A CPU test (``tests/test_options.py``) asserts the names
    and types match the fields. One deliberate difference: ``lazy`` also takes the
    ``True``/``False`` shorthand here.
    """

    sizes: Sequence[int] | None
    fill_values: FillValue | Sequence[FillValue] | None
    names: Sequence[str] | None
    before_capture: Sequence[Hook] | None
    workspaces: Sequence[Any] | None
    state: Any
    progress: bool | None
    name: str | None
    canary: Canary | None
    lazy: Lazy | bool | None
    provenance: bool | None


KEYWORD_OPTIONS: tuple[str, ...] = tuple(
    n for n in OPTION_NAMES if n in CaptureKwargs.__annotations__
)
"""The options every runner takes as keywords (:class:`CaptureKwargs`), in field order."""
_NEVER_KEYWORDS = frozenset({"output_batch_dims"})
"""Options added after 0.4: never runner keywords, so not "moved"."""
OPTIONS_ONLY: tuple[str, ...] = tuple(n for n in OPTION_NAMES if n not in KEYWORD_OPTIONS)
"""The options set through ``options=CaptureOptions(...)`` only (keywords until 0.3)."""

for _name in OPTIONS_ONLY:
    if _name in _NEVER_KEYWORDS:
        MOVED_OPTIONS[_name] = (
            f"{_name} is set through options=graphguard.CaptureOptions({_name}=...) (the "
            "options set on few runners are CaptureOptions fields only, so a runner's "
            "signature stays small)"
        )
        continue
    MOVED_OPTIONS[_name] = (
        f"{_name} moved into options=graphguard.CaptureOptions({_name}=...) in 0.4 (the "
        "options set on few runners are CaptureOptions fields only, so a runner's "
        "signature stays small)"
    )


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
    hints = {  # what a caller may pass: CaptureKwargs' types (lazy takes True/False too)
        k: getattr(v, "__forward_arg__", v) for k, v in CaptureKwargs.__annotations__.items()
    }
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[n])
        for n in KEYWORD_OPTIONS
        if n not in taken
    ]
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return func


__all__ = [
    "KEYWORD_OPTIONS",
    "MOVED_OPTIONS",
    "OPTIONS_ONLY",
    "OPTION_NAMES",
    "PROVENANCE_ENV",
    "SANITIZE_ENV",
    "Canary",
    "CaptureKwargs",
    "CaptureOptions",
    "FillValue",
    "Hook",
    "KeywordsChecked",
    "Lazy",
    "Mode",
    "OnDivergence",
    "check_flag",
    "check_tolerances",
    "option_keywords",
    "sanitize_enabled",
    "unknown_message",
]
