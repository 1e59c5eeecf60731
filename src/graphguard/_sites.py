"""The user's ``file:line``: one rule for every graphguard error that points at user code.

A frame is *library* when its file lives in torch's package directory, in graphguard's
own package directory, or is interpreter plumbing (``contextlib``, ``functools``,
frozen modules); every other frame is the user's. So code in another package (an
application, graphguard's reference app ``graphguard_ref``, a test) is user code
without graphguard knowing where it lives. Walking frames is cheap and runs only
on error and sanitizer paths, never on the replay path.
"""

from __future__ import annotations

import os
import sys
from types import FrameType, TracebackType

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP_FILES = ("contextlib.py", "functools.py", "<frozen ")


def is_library_file(filename: str) -> bool:
    """Whether a frame of ``filename`` is plumbing (torch, graphguard) rather than user code."""
    if filename.startswith("<"):
        return any(s in filename for s in _SKIP_FILES)
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR) or path.startswith(_PKG_DIR):
        return True
    return any(s in filename for s in _SKIP_FILES)


def _format(filename: str, line: int, function: str | None) -> str:
    return f"{filename}:{line}" + (f" ({function})" if function else "")


def user_site(frame: FrameType | None = None, *, function: bool = True) -> str:
    """``file:line (function)`` of the innermost user frame, walking out from ``frame``.

    ``frame`` defaults to the caller's frame; ``function=False`` leaves out the
    function name (``file:line``, as :attr:`WorkspaceLockedError.site` holds it).
    """
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        code = f.f_code
        if not is_library_file(code.co_filename):
            return _format(code.co_filename, f.f_lineno, code.co_name if function else None)
        f = f.f_back
    return "<unknown>"


def user_site_of_traceback(tb: TracebackType | None) -> str:
    """The innermost user frame of an exception's traceback (where the user's code was)."""
    site = "<unknown>"
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_library_file(code.co_filename):
            site = _format(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return site


__all__ = ["is_library_file", "user_site", "user_site_of_traceback"]
