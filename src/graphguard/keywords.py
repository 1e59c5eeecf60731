"""The typed runner keywords: which :class:`~graphguard.CaptureOptions` fields every
runner also takes as a keyword (:class:`CaptureKwargs`, :data:`KEYWORD_OPTIONS`), which
are set through ``options=`` alone (:data:`OPTIONS_ONLY`), and what a runner checks its
``**kwargs`` against (:func:`runner_keywords`).

A runner's ``__init__`` takes ``**kwargs: Unpack[CaptureKwargs]``: mypy and IDEs check
each keyword at the call site, and the ``__init__`` checks them again at run time
(:func:`graphguard.arguments.check_keywords`), so a misspelt one is a
:class:`~graphguard.errors.ConfigError` saying "did you mean", and a moved one
(:data:`MOVED_OPTIONS`) where it went.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, TypeVar

from graphguard.arguments import MOVED_OPTIONS
from graphguard.options import OPTION_NAMES, Canary, FillValue, Lazy
from graphguard.sizes import Hook


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
OPTIONS_ONLY: tuple[str, ...] = tuple(n for n in OPTION_NAMES if n not in KEYWORD_OPTIONS)
"""The options set through ``options=CaptureOptions(...)`` only (keywords until 0.3); each
has its entry in :data:`MOVED_OPTIONS`, which says so."""


def runner_keywords(init: Callable[..., Any]) -> tuple[str, ...]:
    """What a runner's ``init`` takes by keyword: its own keyword-only parameters, then
    the option keywords its ``**kwargs`` receive (the list an unknown-keyword error
    gives, :func:`graphguard.arguments.check_keywords`)."""
    code = init.__code__
    own = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    return (*own, *(n for n in KEYWORD_OPTIONS if n not in own))


_F = TypeVar("_F", bound=Callable[..., Any])


def option_keywords(func: _F) -> _F:
    """Show the option keywords in ``help()`` and ``inspect.signature``.

    ``**kwargs: Unpack[CaptureKwargs]`` is what type checkers read, and ``inspect`` shows
    it as ``**kwargs``; this replaces it in the runtime signature by one keyword-only
    parameter per option (default ``None``: the runner's default), so
    ``help(GraphRunner)`` lists them too. Documentation only: nothing that builds a
    runner reads it (the ``__init__`` checks its keywords itself, :func:`runner_keywords`).
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
    "CaptureKwargs",
    "option_keywords",
    "runner_keywords",
]
