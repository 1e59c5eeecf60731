"""One arena handed out on two streams in one step.

Every :meth:`~graphguard.Workspace.get` carves its views from offset 0, so when the
main stream and an auxiliary branch both take views of the same arena in one step,
their views alias the same bytes: once the branch overlaps (capture, serving) one
stream overwrites the other's scratch. During each sanitized forward :class:`ArenaWatch`
notes, for every arena it knows, the stream (the active :class:`~graphguard.AuxStream`
branch and, on CUDA, the current stream) of each ``get``, and raises
:class:`~graphguard.errors.ArenaStreamAliasError` at the second stream. It sees this
already in the inline warmups, before anything races.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from graphguard import streams
from graphguard._sites import user_site
from graphguard.errors import ArenaStreamAliasError
from graphguard.workspace import Workspace


def _stream_key(device: torch.device) -> tuple[str | None, int | None]:
    branch = streams.current_branch()
    raw: int | None = None
    if device.type == "cuda" and torch.cuda.is_available():
        raw = int(torch.cuda.current_stream(device).cuda_stream)
    return (branch, raw)


def _describe(key: tuple[str | None, int | None]) -> str:
    branch, raw = key
    where = f"auxiliary branch {branch!r}" if branch is not None else "the main stream"
    return where + (f" (CUDA stream {raw:#x})" if raw is not None else "")


class ArenaWatch:
    """Context manager: observe the ``get`` calls of ``arenas`` on this thread for one step."""

    def __init__(self, owner: str, size: int, when: str, arenas: Sequence[Workspace]) -> None:
        self.owner = owner
        self.size = size
        self.when = when
        self.arenas = list({id(a): a for a in arenas}.values())
        self.thread = threading.get_ident()
        self._firsts: dict[int, dict[tuple[str | None, int | None], str]] = {}
        self._observing = contextlib.ExitStack()

    def __enter__(self) -> ArenaWatch:
        for ws in self.arenas:
            self._observing.enter_context(ws.observe(self._seen))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._observing.close()

    def _seen(self, ws: Workspace) -> Any:
        if threading.get_ident() != self.thread:
            return
        key = _stream_key(ws.device)
        firsts = self._firsts.setdefault(id(ws), {})
        if key in firsts:
            return
        firsts[key] = user_site()
        if len(firsts) < 2:
            return
        (k1, s1), (k2, s2) = list(firsts.items())[:2]
        raise ArenaStreamAliasError(
            f"{self.owner}: workspace arena {ws.name!r} was handed out on {_describe(k1)} "
            f"at {s1} and on {_describe(k2)} at {s2} in the same step ({self.when} of size "
            f"{self.size}). Every Workspace.get() starts at offset 0, so the two streams' "
            "views alias the same bytes and overwrite each other once the branch overlaps "
            "(capture and serving). To fix: give each stream its own arena (e.g. "
            f"Workspace({ws.name + '-aux'!r}) for the branch, passed to workspaces=[...]), "
            "or take all of this step's views in one get() call on one stream.",
            arena=ws.name,
            sites=[s1, s2],
        )


__all__ = ["ArenaWatch"]
