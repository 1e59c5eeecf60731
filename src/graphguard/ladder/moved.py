"""The runner members 0.4 moved to ``runner.door`` (or removed), named on their old
spelling: ``runner.capture_sizes`` raises an ``AttributeError`` saying where it lives now,
not Python's "did you mean 'captured_sizes'?".

Why a table and a ``__getattr__``: the members must stay off the runner's face (the door
is apart from it, ``tests/test_layout.py``), yet an engine upgraded from 0.3 should learn
the new spelling from the error. ``__getattr__`` runs only when normal lookup fails, so
the replay path (whose lookups all hit) never reaches it; it answers the known names only
and forwards nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphguard.errors import MovedAttributeError

MOVED_TO_DOOR: dict[str, str] = {
    "capture_sizes": "runner.door.capture(sizes, how=...)",
    "drop_size": "runner.door.drop_size(size)",
    "refuse": "runner.door.refuse(size, status, why)",
    "replay_entry": "runner.door.replay_entry(entry, inputs)",
    "replay_detached": "runner.door.replay_detached(inputs, exc)",
    "entries": "runner.door.entries",
    "pad_table": "runner.door.pad_table",
    "narrows": "runner.door.narrows",
    "exclusive": "runner.door.exclusive(what)",
    "ledger": "runner.door.ledger",
    "generators": "runner.door.generators()",
    "recapture_moved": "runner.door.recapture_moved(found, reason)",
    "unpad": "runner.door.unpad(out, inputs, rows, n)",
    "weights": "runner.door.weights",
    "graph_keys": "runner.door.graph_keys",
    "derived_reads": "runner.door.derived_reads()",
}
"""Member -> its home on the door since 0.4 (CHANGELOG 0.4, "the runner composed of parts")."""

REMOVED: dict[str, str] = {
    "graph_reads": "what each graph reads is runner.audit().graphs",
    "reads_by_graph": "what each graph reads is runner.audit().graphs",
    "prove_graph": "provenance proves each graph itself; read runner.audit()",
    "autocast_policy": "the graphs' autocast policy is runner.report.autocast",
    "rebuild_entries": "the door rebuilds the entries itself (runner.door.drop_size, refuse)",
}
"""Member -> what replaces it (removed in 0.4, with no one-to-one new home)."""


def moved_message(kind: str, name: str) -> str | None:
    """What ``kind.name`` became in 0.4 (None: ``name`` is not one of its old members)."""
    if name in MOVED_TO_DOOR:
        home = MOVED_TO_DOOR[name]
        return (
            f"{kind}.{name} moved to runner.door.{name} in 0.4 (the serving-time operations "
            f"live on the door, docs/serving.md): use {home}"
        )
    if name in REMOVED:
        return f"{kind}.{name} was removed in 0.4: {REMOVED[name]}"
    return None


class MovedMembers:
    """Mixed into a runner: its 0.4 moved members raise :class:`MovedAttributeError`."""

    if not TYPE_CHECKING:  # to mypy, a __getattr__ would make every misspelt member typed

        def __getattr__(self, name: str) -> object:
            kind = type(self).__name__
            text = moved_message(kind, name)
            if text is None:
                raise AttributeError(
                    f"{kind!r} object has no attribute {name!r}", name=name, obj=self
                )
            raise MovedAttributeError(text)  # no name: Python would add "did you mean"


__all__ = ["MOVED_TO_DOOR", "REMOVED", "MovedMembers", "moved_message"]
