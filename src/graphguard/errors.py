"""Every public error graphguard raises.

Each message says what happened, where (which size, which input, which arena,
which op), and what to change. All derive from :class:`GraphGuardError` so an
engine can catch the family with one ``except``.
"""

from __future__ import annotations


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
    """

    def __init__(self, message: str, *, size: int, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.size = size
        self.cause = cause


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
    """Graph replay and eager execution disagree beyond the dtype's tolerance."""


__all__ = [
    "BusyStreamError",
    "CaptureTripwireError",
    "CaptureUnsafeOpError",
    "ConfigError",
    "DivergenceError",
    "FreedStorageError",
    "GraphCaptureError",
    "GraphGuardError",
    "InputMismatchError",
    "SanitizerError",
    "StaleOutputError",
    "UnsupportedModelError",
    "WorkspaceLockedError",
]
