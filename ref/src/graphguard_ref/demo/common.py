"""What the decode demo, the engine demo and the TP demo share: the batch schedule,
sequence bookkeeping, the graph-vs-eager check loop, the timed loop, the result.

Contract: every loop here feeds each step's greedy tokens into the next, so a graph
step and an eager step see the same inputs only when they agree; checks compare the
two on the same cache state, step by step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphguard.errors import ConfigError
from graphguard_ref.timing import StepTimer

DEFAULT_PHASES = (8, 1, 37, 256)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def batch_schedule(steps: int, phases: Sequence[int], max_batch: int) -> list[int]:
    """``steps`` batch sizes: equal segments of each phase value, capped at ``max_batch``."""
    if steps < 1 or not phases:
        raise ConfigError("the demo needs at least one step and one batch size")
    if any(p < 1 for p in phases):
        raise ConfigError(f"the demo's batch sizes (phases) must be >= 1, got {list(phases)}")
    per = max(1, steps // len(phases))
    return [min(max_batch, phases[min(i // per, len(phases) - 1)]) for i in range(steps)]


class Sequences:
    """Slot bookkeeping: rows 0..b-1 are live sequences at their own positions.

    A batch shrinking finishes the sequences past it; growing starts new ones at
    position 0; a sequence reaching the context end restarts (a new request).
    """

    def __init__(self, max_batch: int, max_context: int, device: torch.device) -> None:
        self.max_context = max_context
        self.device = device
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.arange(max_batch, dtype=torch.long, device=device)
        self.live = 0

    def step_inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b > self.live:
            self.positions[self.live : b] = 0
        self.live = b
        pos = self.positions[:b].clone()
        self.positions[:b] = (self.positions[:b] + 1) % self.max_context
        return pos, self.slots[:b]


def next_tokens(tokens: torch.Tensor, first: torch.Tensor, b: int) -> torch.Tensor:
    """The ``b`` input tokens of a step: last step's greedy tokens, new rows from ``first``."""
    if tokens.shape[0] >= b:
        return tokens[:b]
    return torch.cat([tokens, first[tokens.shape[0] : b]])


def check_decode_loop(
    graph: DecodeStep,
    eager: DecodeStep,
    schedule: Sequence[int],
    seqs: Sequences,
    first: torch.Tensor,
) -> dict[str, Any]:
    """Each step through ``graph``, then ``eager`` on the same state; the agreement."""
    tokens = first
    worst, agree, total, bitwise = 0.0, 0, 0, 0
    for b in schedule:
        pos, slots = seqs.step_inputs(b)
        tok = next_tokens(tokens, first, b)
        g = graph(tok, pos, slots).float().clone()
        e = eager(tok, pos, slots).float()
        worst = max(worst, float((g - e).abs().max()))
        bitwise += int(torch.equal(g, e))
        agree += int((g.argmax(-1) == e.argmax(-1)).sum())
        total += b
        tokens = g.argmax(-1)
    return {
        "steps": len(schedule),
        "max_abs_logit_diff": worst,
        "argmax_agreement": agree / max(total, 1),
        "tokens_checked": total,
        "bitwise_equal_steps": bitwise,
    }


def time_decode_loop(
    step: DecodeStep, schedule: Sequence[int], seqs: Sequences, first: torch.Tensor
) -> dict[int, list[float]]:
    """Per-step GPU milliseconds (:class:`~graphguard_ref.timing.StepTimer`) by batch size."""
    timer: StepTimer[int] = StepTimer()
    tokens = first
    for b in schedule:
        pos, slots = seqs.step_inputs(b)
        logits = timer.run(b, step, next_tokens(tokens, first, b), pos, slots)
        tokens = logits.argmax(-1)
    return timer.results()


@dataclass
class DemoResult:
    """What a demo run measured; written as JSON by ``--json``."""

    device: str
    preset: str
    mode: str
    steps: int
    capture: dict[str, Any] | None = None
    per_batch: list[dict[str, float]] = field(default_factory=list)
    check: dict[str, Any] = field(default_factory=dict)
    loop: str = "decode"
    requested_mode: str | None = None
    spec_tokens: int = 0
    plan: dict[str, Any] | None = None
    dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    per_kind: list[dict[str, Any]] = field(default_factory=list)
    sanitize: bool = False


def sanitizer_line(runner: Any) -> str:
    """What ``--sanitize`` turned on, said once: nothing else in the output shows it."""
    return (
        f"sanitizer: on (--sanitize; the runner is a {type(runner).__name__}): before each "
        "replay every storage the graphs captured is checked (freed, resized or moved: "
        "FreedStorageError) and every weight (rebound: ReboundTensorError); reading an output "
        "that a later replay overwrote raises StaleOutputError"
    )


def routes(runner: Any, batches: Sequence[int]) -> str:
    """Each batch and what runs it: the graph it pads to, or eager above the ladder."""
    largest = max(runner.sizes)
    return ", ".join(
        f"{b}->{p}" if (p := runner.padded_size(b)) else f"{b} eager (above {largest})"
        for b in batches
    )


def write_json(data: Any, path: Path | None, out: Callable[[str], None]) -> None:
    """Write ``data`` (a dict or a dataclass) as indented JSON to ``path``, if given."""
    if path is None:
        return
    payload = data.__dict__ if hasattr(data, "__dataclass_fields__") else data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    out(f"wrote {path}")


__all__ = [
    "DEFAULT_PHASES",
    "DemoResult",
    "Sequences",
    "batch_schedule",
    "check_decode_loop",
    "next_tokens",
    "routes",
    "sanitizer_line",
    "time_decode_loop",
    "write_json",
]
