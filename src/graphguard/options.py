"""The options every runner shares (:class:`CaptureOptions`) and the option objects of
one feature (:class:`Canary`, ``canary=``; :class:`Lazy`, ``lazy=``).

:class:`CaptureOptions` holds what the caller *set* of the arguments every runner shares;
a field left ``None`` means "the runner's default". Each runner resolves it once
(:meth:`CaptureOptions.resolved`) into ``runner.options``, so a wrapper
(``DistributedGraphRunner``, the dispatcher, ``GraphedCausalLM``) supplies its own
defaults without ever overriding a value the caller passed. The runner kind (``mode``)
and the kind-specific arguments (``compile``, ``split_ops``, ``share_outputs``,
``sanitize``, ...) are runner keywords, not options, so one options object serves every
runner. Each option is declared once, as a field with its runner default
(:meth:`CaptureOptions.defaults`); which of them a runner also takes as keywords is
:mod:`graphguard.keywords`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from graphguard.arguments import (
    MOVED_OPTIONS,
    KeywordChecked,
    check_flag,
    check_keywords,
    check_list,
    check_tolerances,
    one_of,
    type_name,
)
from graphguard.errors import ConfigError
from graphguard.outputs import check_output_dims
from graphguard.report import VerifyReport
from graphguard.sizes import Hook, validate_sizes

FillValue = int | float | bool
_Opt = TypeVar("_Opt", bound="CaptureOptions")

# ------------------------------------------------------- the option objects of a feature

OnDivergence = str | Callable[[VerifyReport], Any]
_DIVERGENCE_MODES = ("warn", "raise", "eager")


@dataclass(frozen=True)
class Canary(KeywordChecked):
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
class Lazy(KeywordChecked):
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
class CaptureOptions(KeywordChecked):
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
        """Check every field set, and normalize (frozen: once, here)."""
        self._check_ladder()
        self._check_lists()
        for flag in ("copy_outputs", "progress", "provenance"):
            if getattr(self, flag) is not None:
                check_flag(flag, getattr(self, flag))
        self._check_features()
        self._check_names()

    def _check_ladder(self) -> None:
        """``sizes``, ``max_size`` (one source of the ladder) and ``warmup_iters``."""
        if self.sizes is not None:
            object.__setattr__(self, "sizes", validate_sizes(self.sizes))
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

    def _check_lists(self) -> None:
        """The hooks, arenas and generators: lists of what each must be, kept as tuples."""

        def arena(w: Any) -> bool:
            return callable(getattr(w, "lock", None)) and callable(getattr(w, "unlock", None))

        for name, item, ok in (
            ("before_capture", "hook", callable),
            ("after_capture", "hook", callable),
            ("workspaces", "Workspace", arena),
            ("generators", "torch.Generator", lambda g: isinstance(g, torch.Generator)),
        ):
            value = getattr(self, name)
            if value is not None:
                check_list(name, value, item, ok)
                object.__setattr__(self, name, tuple(value))

    def _check_features(self) -> None:
        """``lazy`` (``True``/``False`` normalized), ``output_batch_dims``, the two error
        policies and ``canary``."""
        lazy: object = self.lazy
        if lazy is True:
            object.__setattr__(self, "lazy", Lazy())
        elif lazy is False:
            object.__setattr__(self, "lazy", None)
        elif lazy is not None and not isinstance(lazy, Lazy):
            raise ConfigError(
                f"lazy must be a graphguard.Lazy(...), True (Lazy()) or False, got "
                f"{type_name(lazy)} {lazy!r:.60}; e.g. "
                "lazy=graphguard.Lazy(capture_now=[1, 8], budget=2 << 30)"
            )
        dims = self.output_batch_dims
        if dims is not None:
            object.__setattr__(self, "output_batch_dims", check_output_dims(dims))
        if self.on_capture_error is not None:
            one_of("on_capture_error", self.on_capture_error, ("raise", "skip"))
        if self.capture_error_mode is not None:
            one_of(
                "capture_error_mode",
                self.capture_error_mode,
                ("global", "thread_local", "relaxed"),
            )
        if self.canary is not None and not isinstance(self.canary, Canary):
            raise ConfigError(
                f"canary must be a graphguard.Canary, got {type_name(self.canary)} "
                f"{self.canary!r:.60}; e.g. canary=graphguard.Canary(every=1000)"
            )

    def _check_names(self) -> None:
        """``name`` and ``names``: strings."""
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
        check_keywords(where, given, _KEYWORDS)
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
"""Every option, in field order."""
_KEYWORDS = tuple(n for n in OPTION_NAMES if n not in MOVED_OPTIONS)
"""The options a runner takes as keywords: those not set through ``options=`` alone
(:data:`graphguard.keywords.KEYWORD_OPTIONS`, typed there)."""


__all__ = [
    "EVICT",
    "OPTION_NAMES",
    "Canary",
    "CaptureOptions",
    "FillValue",
    "Hook",
    "Lazy",
    "OnDivergence",
]
