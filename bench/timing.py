"""Timing helpers shared by the benchmarks (run them as ``python bench/<name>.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def host_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median host microseconds per call of ``fn``.

    Blocks of ``calls`` calls timed with ``perf_counter``; each block ends in an untimed
    synchronize, so a short block never fills the launch queue and the host never waits
    for the GPU inside a timed block. 20 warm-up calls first.
    """
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)
