"""The configuration names in one import: the mode, the options, the typed keywords and
the construction checks, each defined in a module of its own.

* :mod:`graphguard.mode` -- :class:`Mode`, how a runner executes a batch;
* :mod:`graphguard.options` -- :class:`CaptureOptions` and the option objects of one
  feature, :class:`Canary` and :class:`Lazy`;
* :mod:`graphguard.keywords` -- the options every runner also takes as keywords
  (:class:`CaptureKwargs`, :data:`KEYWORD_OPTIONS`, :data:`OPTIONS_ONLY`);
* :mod:`graphguard.arguments` -- the checks a runner and an option object run on what
  they are built with: one value, the environment switches, the unknown keyword
  (:data:`MOVED_OPTIONS`).

Users and the library import these names from here or from their module alike.
"""

from __future__ import annotations

import warnings
from typing import Any

from graphguard.arguments import (
    MOVED_OPTIONS,
    PROVENANCE_ENV,
    SANITIZE_ENV,
    check_flag,
    check_tolerances,
    env_switch,
    sanitize_enabled,
    unknown_message,
)
from graphguard.keywords import (
    KEYWORD_OPTIONS,
    OPTIONS_ONLY,
    CaptureKwargs,
    option_keywords,
)
from graphguard.mode import Mode
from graphguard.options import (
    EVICT,
    OPTION_NAMES,
    Canary,
    CaptureOptions,
    FillValue,
    Hook,
    Lazy,
    OnDivergence,
)


def __getattr__(name: str) -> Any:
    """``KeywordsChecked``, the metaclass runners and option objects were built through
    until 0.4: deprecated, and ``type`` (checking nothing) for a class still naming it."""
    if name == "KeywordsChecked":
        warnings.warn(
            "graphguard.config.KeywordsChecked is deprecated: runners check their keywords "
            "in __init__ (graphguard.arguments.check_keywords) and the option objects "
            "through graphguard.arguments.KeywordChecked; a class built with it checks "
            "nothing",
            DeprecationWarning,
            stacklevel=2,
        )
        return type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EVICT",
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
    "Lazy",
    "Mode",
    "OnDivergence",
    "check_flag",
    "check_tolerances",
    "env_switch",
    "option_keywords",
    "sanitize_enabled",
    "unknown_message",
]
