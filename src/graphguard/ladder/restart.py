"""The first half of every full recapture, shared by a runner and the wrappers that
recapture one (the dispatcher, the distributed runner): a named reason, the graphs
dropped and the arenas unlocked on purpose."""

from __future__ import annotations

import logging
from typing import Any

from graphguard.errors import ConfigError

logger = logging.getLogger("graphguard")


def check_reason(reason: object) -> None:
    """A recapture is never an accident: it names why."""
    if not reason or not isinstance(reason, str):
        raise ConfigError("recapture needs a reason, e.g. recapture(reason='weights reloaded')")


def start_over(runner: Any, reason: str) -> None:
    """The first half of every full recapture (this runner's and a distributed one's):
    drop every graph and unlock the arenas on purpose, logged with ``reason``."""
    check_reason(reason)
    with runner.door.exclusive("recapture()"):
        logger.warning("%s: recapturing (%s)", runner.name, reason)
        runner.release()
        for ws in runner.options.workspaces or ():
            ws.unlock(reason=reason)


__all__ = ["check_reason", "start_over"]
