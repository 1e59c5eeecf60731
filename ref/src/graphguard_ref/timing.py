"""The one GPU timer of the demos and benchmarks: CUDA events, and host-side clocks.

Contract: GPU times are milliseconds between two CUDA events recorded on the current
stream, read after one synchronize (never inside the timed region); host times come
from ``time.perf_counter``. :class:`StepTimer` times a loop step by step (grouped by a
label, e.g. the batch size); :func:`cuda_ms` times back-to-back calls (a decode loop,
host overhead hidden); :func:`isolated_ms` times each call on an idle GPU (launch
latency exposed); :func:`host_us` and :func:`idle_host_us` time the host side alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class StepTimer(Generic[K]):
    """Per-step GPU milliseconds of a loop, grouped by label, with one sync at the end.

    ``timer.run(label, fn, *args)`` records an event pair around one call and returns
    its result, so the loop keeps feeding outputs forward; :meth:`results` synchronizes
    once and returns ``{label: [ms, ...]}`` in call order.
    """

    def __init__(self) -> None:
        self._marks: list[tuple[K, Any, Any]] = []

    def run(self, label: K, fn: Callable[..., T], *args: Any) -> T:
        start, end = _event(), _event()
        start.record()
        out = fn(*args)
        end.record()
        self._marks.append((label, start, end))
        return out

    def results(self) -> dict[K, list[float]]:
        torch.cuda.synchronize()
        grouped: dict[K, list[float]] = {}
        for label, start, end in self._marks:
            grouped.setdefault(label, []).append(float(start.elapsed_time(end)))
        return grouped


def cuda_ms(
    fn: Callable[[], Any], reps: int, *, blocks: int = 5, warmup: int = 5, cuda: bool = True
) -> float:
    """ms per call of ``reps`` back-to-back calls, median over ``blocks`` blocks.

    As in a decode loop: the host runs ahead, so host overhead shorter than the GPU
    time is hidden. ``cuda=False`` (a CPU plumbing run) uses host wall time instead.
    """
    for _ in range(warmup):
        fn()
    times = []
    if not cuda:
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(blocks):
        start, end = _event(), _event()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / reps)
    return statistics.median(times)


def isolated_ms(fn: Callable[[], Any], reps: int, *, warmup: int = 0) -> float:
    """Median ms of one call started on an idle GPU (synchronized before each call).

    Host launch latency is exposed, as for the first step after the host waited.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return statistics.median(times)


def host_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median host microseconds per call of ``fn``, over blocks of ``calls`` calls.

    Each block ends in an untimed synchronize, so a short block never fills the launch
    queue and the host never waits for the GPU inside a timed block. 20 warm-up calls.
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


def idle_host_us(fn: Callable[[], Any], reps: int = 200) -> float:
    """Median host microseconds of one call issued on an idle GPU (queue never full)."""
    for _ in range(10):
        fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


__all__ = ["StepTimer", "cuda_ms", "host_us", "idle_host_us", "isolated_ms"]
