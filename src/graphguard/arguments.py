"""The checks a runner and an option object run on what they are built with.

One value at a time (:func:`check_flag`, :func:`check_tolerances`, lists and choices),
the environment switches (:data:`SANITIZE_ENV`, :data:`PROVENANCE_ENV`), and the
unknown keyword: :func:`check_keywords` in a runner's ``__init__`` and
:class:`KeywordChecked` under the option objects turn a misspelt or moved keyword into a
:class:`ConfigError` that names the closest argument, or where a moved one went
(:data:`MOVED_OPTIONS`). Python's own ``TypeError: unexpected keyword argument`` names
neither.

This module sits below the option objects (:mod:`graphguard.options`), which check their
own keywords here: so the option names it lists are written out, and
``tests/test_options.py`` holds them to the :class:`~graphguard.CaptureOptions` fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

from graphguard.errors import ConfigError

# ----------------------------------------------------------------- checks of one value


def type_name(x: object) -> str:
    """What a wrong value is, for a message: ``a function`` or its type's name."""
    return "a function" if callable(x) and not isinstance(x, type) else type(x).__name__


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def check_flag(name: str, value: object) -> None:
    """A flag is ``True`` or ``False``: ``"false"`` or ``0`` would read as something else."""
    if not isinstance(value, bool):
        raise ConfigError(
            f"{name} must be True or False, got {type_name(value)} {value!r:.60}"
            + (
                f"; a string is not a flag (pass {name}={value.strip().lower() in _TRUE})"
                if isinstance(value, str)
                else ""
            )
        )


def check_list(name: str, value: Any, item: str, ok: Callable[[Any], bool]) -> None:
    """``value`` is a list or tuple whose every entry passes ``ok`` (an ``item``)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{name} must be a list of {item}s, got {type_name(value)} {value!r:.60}; pass "
            f"{name}=[...] (e.g. {name}=[x] for one)"
        )
    for i, v in enumerate(value):
        if not ok(v):
            raise ConfigError(
                f"{name}[{i}] is {type_name(v)} {v!r:.60}, not a {item}; pass {name}=[{item}, ...]"
            )


def one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ConfigError(f"{name} must be {listed}, got {type_name(value)} {value!r:.60}")


def check_tolerances(where: str, rtol: Any, atol: Any) -> None:
    """``rtol``/``atol`` are numbers >= 0 or None (the per-dtype default); the one check of
    :func:`~graphguard.verify` and :class:`~graphguard.Canary`."""
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


# ------------------------------------------------------------ the environment switches

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


# ----------------------------------------------------------------- the unknown keyword

_WRAPPERS = "DistributedGraphRunner, build_dispatcher and GraphedCausalLM take it too"
_OPTIONS_ONLY_SINCE_0_4 = (
    "max_size",
    "batch_dims",
    "warmup_iters",
    "after_capture",
    "copy_outputs",
    "capture_error_mode",
    "on_capture_error",
    "generators",
    "weights",
)
"""The options that were runner keywords until 0.3 (``CaptureOptions`` fields only since)."""
_OPTIONS_ONLY_ALWAYS = ("output_batch_dims",)
"""Options added after 0.4: never runner keywords, so not "moved"."""
_SMALL = (
    "(the options set on few runners are CaptureOptions fields only, so a runner's "
    "signature stays small)"
)

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
    **{
        n: f"{n} moved into options=graphguard.CaptureOptions({n}=...) in 0.4 {_SMALL}"
        for n in _OPTIONS_ONLY_SINCE_0_4
    },
    **{
        n: f"{n} is set through options=graphguard.CaptureOptions({n}=...) {_SMALL}"
        for n in _OPTIONS_ONLY_ALWAYS
    },
}
"""Keywords a runner or option object does not take, and what to write instead: every
unknown-keyword error (:func:`unknown_message`) says it. The options that 0.3 removed,
then each option set through ``options=CaptureOptions(...)`` only
(:data:`~graphguard.keywords.OPTIONS_ONLY`)."""

_OPTION_FIELDS = frozenset((*_OPTIONS_ONLY_SINCE_0_4, *_OPTIONS_ONLY_ALWAYS))


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
            elif field and field[0] in _OPTION_FIELDS:  # an options-only field, misspelt
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


def check_keywords(where: str, given: Collection[str], known: Sequence[str]) -> None:
    """Every keyword in ``given`` is one of ``known``, else a :class:`ConfigError` from
    :func:`unknown_message`: the first statement of a runner's ``__init__``, over the
    keywords its ``**kwargs`` received (``known``: its own keywords and the option
    keywords, :func:`~graphguard.keywords.runner_keywords`)."""
    unknown = [k for k in given if k not in known]
    if unknown:
        raise ConfigError(unknown_message(where, unknown, known))


class KeywordChecked:
    """Base of the option objects (frozen dataclasses): a keyword that is not a field is
    a :class:`ConfigError` from :func:`unknown_message`, before the generated
    ``__init__`` would raise a bare ``TypeError``. Type checkers read that ``__init__``
    (it comes first in the MRO), so a misspelt field is still caught at the call site."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
            check_keywords(cls.__name__, kwargs, known)
        return super().__new__(cls)


__all__ = [
    "MOVED_OPTIONS",
    "PROVENANCE_ENV",
    "SANITIZE_ENV",
    "KeywordChecked",
    "check_flag",
    "check_keywords",
    "check_list",
    "check_tolerances",
    "env_switch",
    "one_of",
    "sanitize_enabled",
    "type_name",
    "unknown_message",
]
