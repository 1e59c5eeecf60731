"""``print(runner.audit())``: what each graph reads, by name, short enough for a big model.

A 1B model's ladder is 35 graphs, each reading some 150 named tensors: one line per read
is thousands of lines, and counts alone ("reads 146 parameter") name nothing. So the
table groups: graphs that read the same owners are shown once, and each kind's names are
collapsed where they share a path with numbered parts, ``layers.{0..15}.mlp.*`` for the
48 MLP weights of 16 layers (the full names stay in ``audit().graphs``).

:class:`Audit` and the message of a graph taking freed memory live here, apart from the
classification (:mod:`graphguard.provenance`), which builds them; this module imports no
other graphguard module.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_NUMBER = re.compile(r"^\d+$|^\[\d+\]$")

WIDTH = 8
"""Collapsed entries shown per kind and graph group before "... and N more"."""

_ORDER = {k: i for i, k in enumerate(
    ("parameter", "buffer", "state", "static input", "output", "arena", "derived")
)}  # fmt: skip
"""Kinds in :data:`graphguard.owners.KINDS` order."""


def _indices(values: Iterable[int]) -> str:
    """``{0..15}``, ``{0,2,5}``, ``{0..3,8..11}``: a set of layer numbers."""
    vals = sorted(set(values))
    runs: list[str] = []
    start = prev = vals[0]
    for v in [*vals[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(
            f"{start}"
            if start == prev
            else f"{start},{prev}"
            if prev == start + 1
            else f"{start}..{prev}"
        )
        if v is not None:
            start = prev = v
    text = ",".join(runs)
    if len(runs) > 4:
        text = ",".join(runs[:2]) + f",...({len(vals)})"
    return "{" + text + "}"


def _split(name: str) -> list[str]:
    """``layers.3.w[0]`` -> ``["layers", "3", "w", "[0]"]``."""
    parts: list[str] = []
    for p in name.split("."):
        m = re.match(r"^(.*?)((?:\[[^\]]*\])+)$", p)
        if m and m.group(1):
            parts.append(m.group(1))
            parts += re.findall(r"\[[^\]]*\]", m.group(2))
        else:
            parts.append(p)
    return parts


def collapse(names: Sequence[str]) -> list[str]:
    """``names`` shortened: numbered path parts merged into ranges, and what follows the
    first numbered part gathered as ``.*`` where several names share it; each collapsed
    entry ends with its count, e.g. ``layers.{0..15}.mlp.* (48)``."""
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    plain: list[str] = []
    for n in names:
        parts = _split(n)
        nums = [i for i, p in enumerate(parts) if _NUMBER.match(p)]
        if not nums:
            plain.append(n)
            continue
        template = tuple(
            ("[#]" if p.startswith("[") else "#") if i in nums else p for i, p in enumerate(parts)
        )
        groups.setdefault(template, []).append(tuple(int(parts[i].strip("[]")) for i in nums))
    # Templates sharing everything up to one part past the first number: one ``.*`` entry.
    by_head: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for template in groups:
        by_head.setdefault(_head(template), []).append(template)
    out: list[tuple[str, str]] = [(n, n) for n in plain]
    for head, templates in by_head.items():
        values = [v for t in templates for v in groups[t]]
        if len(values) <= 3:  # a few names: each as it is
            names = [_render(t, [v]) for t in templates for v in groups[t]]
            out += [(n, n.replace("{", "").replace("}", "")) for n in names]
        elif len(templates) == 1 or len(head) >= len(templates[0]):
            out += [(_render(t, groups[t]), _render(t, groups[t])) for t in templates]
        else:
            slots = sum(p in _SLOTS for p in head)
            shown = _render(head, [v[:slots] for v in values], count=False)
            leaves = sorted({t[len(head)] for t in templates if len(t) == len(head) + 1})
            rest = "{" + ",".join(leaves) + "}" if len(leaves) == len(templates) else "*"
            out.append((shown, f"{shown}.{rest if len(rest) <= 48 else '*'} ({len(values)})"))
    return [label for _, label in sorted(out)]


_SLOTS = ("#", "[#]")


def _head(template: tuple[str, ...]) -> tuple[str, ...]:
    """What ``.*`` gathers a template under: up to one part past its first number, or up
    to the number when that part is the last (``layers.#.weight`` and ``layers.#.bias``
    gather as ``layers.#.*``; ``layers.#.mlp.up.weight`` as ``layers.#.mlp.*``)."""
    first = next(i for i, p in enumerate(template) if p in _SLOTS)
    return template[: first + 2] if len(template) > first + 2 else template[: first + 1]


def _render(
    template: Sequence[str], values: Sequence[tuple[int, ...]], *, count: bool = True
) -> str:
    text = ""
    k = 0
    for p in template:
        if p in _SLOTS:
            part = _indices(v[k] for v in values)
            part = f"[{part}]" if p == "[#]" else part
            k += 1
        else:
            part = p
        text += part if not text or part.startswith("[") else "." + part
    return text + (f" ({len(values)})" if count and len(values) > 1 else "")


def _line(kind: str, names: Sequence[str]) -> str:
    shown = collapse(names)
    more = f", ... and {len(shown) - WIDTH} more" if len(shown) > WIDTH else ""
    return f"{kind} ({len(names)}): " + ", ".join(shown[:WIDTH]) + more


def _where(keys: Sequence[tuple[int, int | None]]) -> str:
    if len(keys) == 1:
        s, p = keys[0]
        return f"size {s}" + ("" if p is None else f" piece {p}")
    sizes = sorted({s for s, _ in keys})
    pieces = sorted({p for _, p in keys if p is not None})
    text = f"sizes {_indices(sizes)[1:-1]}"
    if pieces:
        text += f" pieces {_indices(pieces)[1:-1]}"
    return f"{text} ({len(keys)} graphs)"


def table(audit: Any) -> str:
    """The table of an :class:`~graphguard.provenance.Audit` (see the module docstring)."""
    if not audit.enabled:
        return f"{audit.runner}: provenance off ({audit.why})"
    took = f"{audit.seconds * 1e3:.1f} ms"
    lines = [f"{audit.runner}: {len(audit.graphs)} graphs read, {took} ({audit.why})"]
    same: dict[tuple[tuple[str, str], ...], list[Any]] = {}
    for g in audit.graphs:
        sig = tuple(sorted((r.kind, r.name) for r in g.reads if r.kind != "output"))
        same.setdefault(sig, []).append(g)
    for sig, gs in same.items():
        keys = [(g.size, g.piece) for g in gs]
        nodes = sorted({g.kernels for g in gs})
        span = f"{nodes[0]}" if len(nodes) == 1 else f"{nodes[0]}-{nodes[-1]}"
        lines.append(
            f"  {_where(keys)}: {span} nodes; {sum(g.temporaries for g in gs)} pool words; "
            f"{sum(len(g.unknown) for g in gs)} unknown; {sum(len(g.unowned) for g in gs)} "
            "unowned"
        )
        kinds: dict[str, list[str]] = {}
        for kind, name in sorted(sig, key=lambda kn: (_ORDER.get(kn[0], 9), kn[1])):
            kinds.setdefault(kind, []).append(name)
        if not kinds:
            lines.append("      reads no named owner")
        for kind, names in kinds.items():
            lines.append(f"      {_line(kind, names)}")
        for g in gs:
            for w in g.unknown[:5]:
                where = (
                    f"freed memory, undecided: {w.why}" if w.freed else f"{w.nbytes} B allocation"
                )
                lines.append(f"      {g.where}: unknown {w.address:#x} ({where}, by {w.kernel})")
            for w in g.unowned:
                lines.append(
                    f"      {g.where}: UNOWNED {w.address:#x} by {w.kernel}, "
                    f"last owner {w.last_owner}"
                )
    for name, what, keys in audit.stale:
        lines.append(f"  STALE {name}: {what}; read by {_where(list(keys))}")
    for name, why, keys in audit.undecided[:10]:
        lines.append(f"  UNDECIDED {name}: {why}; taken by {_where(list(keys))}")
    if len(audit.undecided) > 10:
        lines.append(f"  ... and {len(audit.undecided) - 10} more undecided")
    return "\n".join(lines)


def freed_message(label: str, gp: Any, *, refused: bool) -> str:
    """What a graph that takes memory no live tensor owns takes, who owned it last, and the
    fix; ``refused``: the graph was destroyed before any replay (the sanitizer), else it
    is kept and serves (a warning)."""
    words = [*gp.unowned, *(w for w in gp.unknown if w.freed)]
    shown = "\n".join(
        f"  - {w.address:#x} taken by {w.kernel}"
        + (f", last owned by {w.last_owner}" if w.last_owner else ", owner never known")
        + ("" if w.proven else f" (undecided: {w.why})")
        for w in words[:10]
    )
    more = f"\n  ... and {len(words) - 10} more" if len(words) > 10 else ""
    fate = (
        "it was refused before any replay"
        if refused
        else "it is kept and serves: its replays read or write that memory"
    )
    return (
        f"{label}: the {gp.where} graph takes {len(words)} pointer(s) into memory no live "
        f"tensor owns (freed, or an arena's replaced buffer; undecided ones: a word that may "
        f"be a pointer and nothing decides, refused under the sanitizer); {fate}:"
        f"\n{shown}{more}\nTo fix: keep every tensor the step reads alive at one "
        "address from before capture on (size arenas before capture and never grow them "
        "after; do not cache a view of an arena or a weight across a reload); then capture "
        "again."
    )


@dataclass(frozen=True)
class Audit:
    """``runner.audit()``: what each graph reads (data; ``print(audit)`` for the table:
    per graph the owners by kind, names collapsed by common prefix; graphs that read the
    same owners shown once; full names in :attr:`graphs`)."""

    runner: str
    enabled: bool
    why: str
    """How provenance was decided (on, off and why)."""
    graphs: tuple[Any, ...]
    stale: tuple[tuple[str, str, tuple[tuple[int, int | None], ...]], ...] = ()
    """(owner, what changed, graphs reading it): named reads whose owner no longer holds
    the storage the graph took (moved, replaced or freed since capture), and unnamed
    allocations a graph is proven to take (an exact pointer argument, or live as the
    capture began) that have been freed since."""
    undecided: tuple[tuple[str, str, tuple[tuple[int, int | None], ...]], ...] = ()
    """(memory, why, graphs): words into memory no live tensor holds that nothing decides
    (a pointer or not): inside a closure or struct whose layout the kernel's types do not
    give, with no record of the capture's ops to decide by (``sanitize=True`` records
    them), or in a library kernel. Never called stale, never silently dropped; under the
    sanitizer a graph taking one is refused."""

    @property
    def unproven(self) -> tuple[tuple[str, tuple[tuple[int, int | None], ...]], ...]:
        """Renamed :attr:`undecided` in 0.4.1 (now with why)."""
        warnings.warn(
            "graphguard.Audit.unproven is now Audit.undecided (memory, why, graphs)",
            DeprecationWarning,
            stacklevel=2,
        )
        return tuple((n, k) for n, _, k in self.undecided)

    @property
    def derived(self) -> tuple[str, ...]:
        """Derived tensors (no module lists them) that some graph reads."""
        return tuple(sorted({r.name for g in self.graphs for r in g.reads if r.kind == "derived"}))

    @property
    def seconds(self) -> float:
        return float(sum(g.seconds for g in self.graphs))

    def reading(self, name: str) -> tuple[tuple[int, int | None], ...]:
        """The graphs (size, piece) that read owner ``name``."""
        return tuple((g.size, g.piece) for g in self.graphs if any(r.name == name for r in g.reads))

    def table(self) -> str:
        return table(self)

    def __str__(self) -> str:
        return self.table()


__all__ = ["Audit", "collapse", "freed_message", "table"]
