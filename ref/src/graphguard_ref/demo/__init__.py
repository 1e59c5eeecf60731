"""``graphguard-demo``: the decode loop, the engine loop and the tensor-parallel loop.

``common`` (schedule, sequences, check and timed loops, result), ``decode`` (one
GraphRunner over ``decode_step``), ``engine`` (``mixed_step`` through a Dispatcher),
``tp`` (``--tp N``, spawning ranks itself when no launcher did).
"""

from __future__ import annotations

from graphguard_ref.demo.common import DEFAULT_PHASES, DemoResult, Sequences, batch_schedule
from graphguard_ref.demo.decode import run_demo, uses_engine_loop
from graphguard_ref.demo.engine import run_engine_demo

__all__ = [
    "DEFAULT_PHASES",
    "DemoResult",
    "Sequences",
    "batch_schedule",
    "run_demo",
    "run_engine_demo",
    "uses_engine_loop",
]
