"""Every public error graphguard raises.

Each message says what happened, where (which size, which input, which arena,
which op), and what to change. All derive from :class:`GraphGuardError` so an
engine can catch the family with one ``except``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphguard.report import VerifyReport


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: how one error is quoted inside another
    (a size's failure in the capture report, a peer rank's failure), so every quote
    reads the same."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class GraphGuardError(RuntimeError):
    """Base class of every graphguard error."""


class ConfigError(GraphGuardError, ValueError):
    """A runner or ladder was configured inconsistently (bad sizes, bad fill values...)."""


class UnsupportedModelError(ConfigError):
    """A model or configuration cannot be graphed token-identically; refused before capture.

    The message names the reason (e.g. dynamic RoPE, a sliding window shorter than the
    cache, flash-attention masks) and the eager fallback. ``reasons`` lists every one.
    """

    def __init__(self, message: str, *, reasons: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reasons = reasons


class InputMismatchError(GraphGuardError, ValueError):
    """A call's inputs do not match what was captured.

    The message lists *every* mismatch (input name, expected, got), not only the first.
    """


class GraphCaptureError(GraphGuardError):
    """Capturing one size failed; the runner stays usable for the sizes that did capture.

    Attributes:
        size: the capture size that failed.
        cause: the underlying exception (usually a CUDA error from the capture).
        report: the :class:`~graphguard.report.CaptureReport` of the capture it stopped
            (the sizes that did capture, with what they took), or None.
    """

    def __init__(self, message: str, *, size: int, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.size = size
        self.cause = cause
        self.report: Any = None


class MovedAttributeError(AttributeError, GraphGuardError):
    """A runner member that moved (to ``runner.door``) or went in a release, asked for by
    its old spelling: the message names its new home and the release that moved it.

    An ``AttributeError``, so ``hasattr`` and ``getattr(runner, name, default)`` behave as
    for any missing attribute."""


class CaptureTripwireError(GraphGuardError):
    """A graph capture was attempted outside graphguard's capture window.

    Graphs hold raw device addresses; a capture that happens lazily while serving
    (a new shape seen for the first time) races the allocator and the arenas. Capture
    only inside ``GraphRunner.capture()`` or an explicit ``phase.capture_window()``.
    """


class WorkspaceLockedError(GraphGuardError):
    """A locked workspace arena was asked for more bytes than it holds.

    After capture, graphs hold pointers into the arena; growing it would free the
    buffer they replay into. Attributes name the arena and the byte counts.
    """

    def __init__(self, message: str, *, arena: str, requested: int, locked: int, site: str) -> None:
        super().__init__(message)
        self.arena = arena
        self.requested = requested
        self.locked = locked
        self.site = site


class BusyStreamError(GraphGuardError):
    """A stream graphguard knows of still had queued work when capture was about to begin."""


class SanitizerError(GraphGuardError):
    """Base class of the hazards the sanitizer detects (``sanitize=True``)."""


class FreedStorageError(SanitizerError):
    """A storage a captured graph reads or writes was freed, resized or moved since capture."""


class StaleOutputError(SanitizerError):
    """An output of an earlier replay was read after a later replay may have overwritten it."""


class CaptureUnsafeOpError(SanitizerError):
    """The captured callable synchronized the host or read a device value on the CPU."""


class DivergenceError(SanitizerError):
    """Graph replay and eager execution disagree beyond the dtype's tolerance.

    Attributes:
        report: the :class:`~graphguard.verify.VerifyReport` of every checked size
            (``None`` when raised without one).
    """

    def __init__(self, message: str, *, report: VerifyReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class ReboundTensorError(SanitizerError):
    """A tensor a captured graph reads was rebound (``module.weight = new``) after capture.

    The graph still reads the old tensor, which stays alive because something else
    references it, so no storage was freed; the replay would silently use old values.

    Attributes:
        path: where the tensor was reached at capture, e.g. ``"model.layers.0.weight"``.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class WeightsMovedError(GraphGuardError):
    """Parameters or buffers the captured graphs read are no longer the module's live
    tensors (rebound, re-materialised, ``.to()``, resized): the graphs would serve the old
    storage. Raised by ``check_weights().raise_if_moved()`` and ``update_weights``.

    Attributes:
        names: every moved name, in module order.
    """

    def __init__(self, message: str, *, names: Sequence[str]) -> None:
        super().__init__(message)
        self.names = tuple(names)


class StaleWeightsError(GraphGuardError):
    """A refit left tensors the captured graphs read unwritten: the graphs would serve
    their old values (a loader that never wrote routed experts, a scale, a derived tensor
    it did not refresh). Raised at the end of ``runner.refit()`` and by
    ``update_weights`` (``strict=False`` only reports, in the verdict).

    Attributes:
        names: every tensor named, in the verdict's order.
    """

    def __init__(self, message: str, *, names: Sequence[str]) -> None:
        super().__init__(message)
        self.names = tuple(names)


class ArenaStreamAliasError(SanitizerError):
    """One workspace arena was handed out on two streams (or branches) in one step.

    Every :meth:`~graphguard.Workspace.get` starts at offset 0, so the views the main
    stream and an auxiliary branch got alias the same bytes and race once they overlap.

    Attributes:
        arena: the arena's name.
        sites: the ``file:line`` of the first ``get`` on each stream.
    """

    def __init__(self, message: str, *, arena: str, sites: Sequence[str]) -> None:
        super().__init__(message)
        self.arena = arena
        self.sites = tuple(sites)


# ---------------------------------------------------------------------- distributed


class DistributedError(GraphGuardError):
    """Ranks disagreed, or a rank did not arrive at a collective in time.

    Attributes:
        rank: the global rank that raised.
        ranks: the global ranks at fault, when known (empty otherwise).
    """

    def __init__(self, message: str, *, rank: int, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.ranks = tuple(ranks)


class BatchMismatchError(DistributedError):
    """Ranks were called with different batch sizes (``on_mismatch="raise"``).

    ``sizes`` maps every global rank to the batch size it was called with.
    """

    def __init__(self, message: str, *, rank: int, sizes: dict[int, int]) -> None:
        smallest = min(sizes.values())
        super().__init__(message, rank=rank, ranks=[r for r, n in sizes.items() if n != smallest])
        self.sizes = dict(sizes)


class CapturePlanMismatchError(ConfigError):
    """Ranks would capture different ladders (or inputs, or modes); nothing was captured.

    ``plans`` maps every global rank to its plan (a dict with ``sizes`` in capture order),
    ``ranks`` lists the ranks whose plan differs from the lowest rank's.
    """

    def __init__(
        self, message: str, *, rank: int, ranks: Sequence[int], plans: dict[int, dict[str, Any]]
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.ranks = tuple(ranks)
        self.plans = plans


class DistributedCaptureError(GraphCaptureError):
    """Capture failed on at least one rank; raised on every rank, naming the failed ones.

    ``failures`` maps each failed global rank to ``(size, message)`` (size -1 when it
    failed outside a size's capture, e.g. in a ``before_capture`` hook). The runner's
    graphs are released on every rank: a ladder that exists on some ranks only would
    replay unmatched collectives.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        failures: dict[int, tuple[int, str]],
        cause: BaseException | None = None,
    ) -> None:
        first = min(failures) if failures else rank
        super().__init__(message, size=failures.get(first, (-1, ""))[0], cause=cause)
        self.rank = rank
        self.ranks = tuple(sorted(failures))
        self.failures = dict(failures)


__all__ = [
    "ArenaStreamAliasError",
    "BatchMismatchError",
    "BusyStreamError",
    "CapturePlanMismatchError",
    "CaptureTripwireError",
    "CaptureUnsafeOpError",
    "ConfigError",
    "DistributedCaptureError",
    "DistributedError",
    "DivergenceError",
    "FreedStorageError",
    "GraphCaptureError",
    "GraphGuardError",
    "InputMismatchError",
    "MovedAttributeError",
    "ReboundTensorError",
    "SanitizerError",
    "StaleOutputError",
    "StaleWeightsError",
    "UnsupportedModelError",
    "WeightsMovedError",
    "WorkspaceLockedError",
]
