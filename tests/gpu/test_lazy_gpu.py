"""Lazy capture on real CUDA graphs (issue 21).

1. The serving-time hazard: a serving step forks a long kernel writing a temporary onto an
   ``AuxStream``; the next call reaches a size not captured yet. graphguard's lazy capture
   synchronizes first, so every known stream is idle when the capture begins, and 500
   random-size steps equal eager, with and without the sanitizer. The same lazy capture
   with the synchronize skipped finds the aux stream still busy (the seed's hazard): the
   idle check refuses it, the size runs eagerly and the result is still right.
2. The soak: 5,000 random batch sizes under lazy capture with the sanitizer on, each result
   (a size's first call, run eagerly as its warmup, or a replay) bitwise equal to eager on
   the padded batch.
3. Threads: lazy captures in one thread while another thread allocates, multiplies and
   synchronizes the device; both stay correct (``capture_error_mode="thread_local"``).
4. The ledger: the driver's share of a 35-size ladder is measured (> 0), the report's pool
   plus driver matches the free device memory the graphs hold, and ``release()`` gives it
   back.

Run on the GPU machine: ``python -m pytest tests/gpu/test_lazy_gpu.py -rA -s``.
"""

from __future__ import annotations

import contextlib
import gc
import random
import threading
import time
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase, streams
from graphguard.backend import drop_blas_workspaces
from graphguard.lazy import capture_lock
from graphguard.phase import Phase
from tests.gpu.test_hazards_gpu import (
    AUX_PRIORITY,
    AuxModel,
    BoundaryBackend,
    close,
    prewarm,
    rand,
    weight,
)

LADDER = [1, 2, 4, 8, 16, 32]
MIB = float(1 << 20)


def say(*args: object) -> None:
    print("[lazy]", *args, flush=True)


pytestmark = pytest.mark.usefixtures("no_tf32")  # conftest.py; cycles_per_ms there too


@pytest.mark.parametrize("sanitize", [False, True])
@torch.inference_mode()
def test_lazy_capture_after_a_step_that_left_the_aux_stream_busy(cycles_per_ms, sanitize):
    aux = gg.AuxStream(f"aux-lazy-{int(sanitize)}", priority=AUX_PRIORITY)
    model = AuxModel(aux, 2 * cycles_per_ms)
    prewarm(model)
    backend = BoundaryBackend()
    runner = gg.GraphRunner(
        model,
        (rand(2),),
        sizes=LADDER,
        lazy=True,
        sanitize=sanitize,
        backend=backend,
        progress=False,
        name=f"lazy-aux-{int(sanitize)}",
    )
    runner.capture()
    assert runner.captured_sizes == ()
    rng = random.Random(21)
    # Size 4's first call (its warmup, eagerly), then a step above the ladder (eager:
    # forks for real), then size 4 again at once: its capture.
    plan = [3, 40, 3] + [rng.choice([rng.randint(1, 32), rng.randint(33, 40)]) for _ in range(497)]
    busy_at_lazy = 0
    kept = []
    for i, n in enumerate(plan):  # no host sync in the loop: eager steps stay in flight
        before = len(runner.captured_sizes)
        aux_busy = not aux.stream.query()
        x = rand(n, seed=1000 + i)
        kept.append((x, runner(x).clone()))
        if len(runner.captured_sizes) > before and aux_busy:
            busy_at_lazy += 1
    worst = max(close(out, model(x)) for x, out in kept)
    torch.cuda.synchronize()
    st = runner.stats()
    say(
        f"sanitize={sanitize}: 500 steps, worst diff {worst:.2e}; lazy captures "
        f"{[lbl for lbl, _ in backend.at_capture]}, {busy_at_lazy} began right after a step "
        f"that left {aux.name} busy; busy at each capture begin: "
        f"{sorted({tuple(b) for _, b in backend.at_capture})}; eager {st.eager_reasons}"
    )
    assert busy_at_lazy >= 1
    assert all(busy == [] for _, busy in backend.at_capture), backend.at_capture
    assert runner.captured_sizes == tuple(LADDER)
    assert st.replays + st.eager_calls == 500
    runner.release()


@torch.inference_mode()
def test_lazy_capture_without_the_synchronize_finds_the_aux_stream_busy(cycles_per_ms):
    aux = gg.AuxStream("aux-lazy-nosync", priority=AUX_PRIORITY)
    model = AuxModel(aux, 50 * cycles_per_ms)
    prewarm(model)
    backend = BoundaryBackend(sync=False)
    runner = gg.GraphRunner(
        model, (rand(2),), sizes=[4, 8], lazy=True, backend=backend, progress=False,
        name="lazy-nosync",
    )  # fmt: skip
    runner.capture()
    runner(rand(3, seed=2))  # size 4's first call: its warmup, eagerly
    torch.cuda.synchronize()
    runner(rand(12, seed=1))  # above the ladder: eager, forks a 50 ms kernel for real
    busy = streams.busy_streams()
    x = rand(3, seed=2)
    out = runner(x).clone()  # size 4 would be captured now, without a synchronize
    torch.cuda.synchronize()
    row = runner.stats().size(4)
    say(f"nosync: busy right after the eager step {busy}; size 4: {row.status} ({row.note})")
    assert aux.name in busy
    assert backend.at_capture == []  # the capture never began
    assert row.status == "failed" and "BusyStreamError" in (row.note or "")
    assert aux.name in (row.note or "")
    close(out, model(x))  # the call still returned the eager result
    runner.release()


class MLP:
    """GEMMs and activations (``layers`` of them): deterministic kernels, no state."""

    def __init__(self, layers: int = 3) -> None:
        self.w = [weight(10 + i) for i in range(layers)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, w in enumerate(self.w):
            h = torch.relu(h @ w) if i % 2 == 0 else torch.tanh(h @ w)
        return h + x


@torch.inference_mode()
def test_soak_5000_random_sizes_equal_eager_on_the_padded_batch_sanitizer_on():
    model = MLP()
    ladder = gg.capture_sizes(64)
    runner = gg.GraphRunner(
        model, (rand(2),), sizes=ladder, lazy=True, sanitize=True, progress=False,
        name="lazy-soak", state=[],
    )  # fmt: skip
    runner.capture()
    rng = random.Random(5000)
    mismatches = 0
    t0 = time.perf_counter()
    for i in range(5000):
        n = rng.randint(1, 72)
        x = rand(n, seed=i)
        out = runner(x)
        size = runner.padded_size(n)
        if size is None:
            want = model(x)
        else:
            padded = torch.zeros(size, x.shape[1], device=x.device)
            padded[:n] = x
            want = model(padded)[:n]
        mismatches += not torch.equal(out, want)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    st = runner.stats()
    say(
        f"soak: 5000 steps in {secs:.1f} s, {mismatches} not bitwise equal; captured "
        f"{len(runner.captured_sizes)}/{len(ladder)} sizes lazily; replays {st.replays}, eager "
        f"{st.eager_calls} {st.eager_reasons}; warnings {st.warnings}"
    )
    assert mismatches == 0
    assert runner.captured_sizes == tuple(ladder)
    assert st.replays + st.eager_calls == 5000
    runner.release()


def _neighbour(stop: threading.Event, errors: list[str], rounds: list[int], locked: bool):
    """Another serving thread's CUDA work: allocations and GEMMs on its own stream, then a
    stream synchronize; ``locked``: all of it, and a device-wide synchronize, under
    ``graphguard.lazy.capture_lock`` (the documented way to share the device with lazy
    captures)."""
    a = torch.randn(512, 512, device="cuda")
    want = (a @ a).sum()
    stream = torch.cuda.Stream()
    with torch.inference_mode(), torch.cuda.stream(stream):
        while not stop.is_set():
            try:
                with capture_lock if locked else contextlib.nullcontext():
                    fresh = torch.empty(512, 512, device="cuda")  # an allocation
                    fresh.copy_(a)
                    got = (fresh @ fresh).sum()
                    stream.synchronize()
                    if locked:
                        torch.cuda.synchronize()
                if not torch.allclose(got, want, rtol=1e-3):
                    errors.append(f"wrong result {got.item()} vs {want.item()}")
                rounds[0] += 1
            except BaseException as exc:  # report, the test asserts
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")


def _serve_beside(locked: bool) -> tuple[Any, list[str], int, float]:
    model = MLP()
    runner = gg.GraphRunner(
        model, (rand(2),), sizes=gg.capture_sizes(64), lazy=True, progress=False,
        name=f"lazy-threads-{int(locked)}", state=[],
    )  # fmt: skip
    runner.capture()
    assert runner.options.capture_error_mode == "thread_local"
    stop = threading.Event()
    errors: list[str] = []
    rounds = [0]
    t = threading.Thread(target=_neighbour, args=(stop, errors, rounds, locked))
    t.start()
    worst = 0.0
    try:
        time.sleep(0.05)
        rng = random.Random(7)
        for i in range(400):
            n = rng.randint(1, 64)
            x = rand(n, seed=i)
            worst = max(worst, close(runner(x).clone(), model(x)))
    finally:
        stop.set()
        t.join(timeout=30)
    torch.cuda.synchronize()
    return runner, errors, rounds[0], worst


@torch.inference_mode()
def test_lazy_captures_beside_a_thread_that_allocates_and_runs_kernels_unlocked():
    """Unlocked, nothing CUDA forbids happens (no error in either thread, every size
    captured); results are recorded, not promised: at 91ebebe one of 477 rounds of a
    thread whose GEMMs ran outside the lock computed a wrong result (see docs/lazy.md, Threads)."""
    runner, errors, rounds, worst = _serve_beside(locked=False)
    st = runner.stats()
    failed = [s.size for s in st.sizes if s.status == "failed"]
    cuda_errors = [e for e in errors if not e.startswith("wrong result")]
    say(
        f"threads unlocked: {len(runner.captured_sizes)} lazy captures beside {rounds} rounds "
        f"of another thread (allocate, GEMM, stream synchronize); its errors {errors[:2]} "
        f"({len(errors) - len(cuda_errors)} wrong results); failed sizes {failed}; worst "
        f"{worst:.2e}"
    )
    assert not cuda_errors and rounds > 0
    assert not failed and runner.captured_sizes == tuple(gg.capture_sizes(64))
    runner.release()


@torch.inference_mode()
def test_another_thread_under_the_capture_lock_may_even_synchronize_the_device():
    """CUDA forbids a device-wide synchronize while any capture runs (measured at 596036c
    without the lock: the other thread's calls raised "operation not permitted when stream
    is capturing" and 10 of 11 lazy captures failed, served eagerly, results right). Work
    under ``graphguard.lazy.capture_lock`` never overlaps a lazy capture."""
    runner, errors, rounds, worst = _serve_beside(locked=True)
    st = runner.stats()
    failed = {s.size: s.note for s in st.sizes if s.status == "failed"}
    say(
        f"threads under capture_lock: {len(runner.captured_sizes)} lazy captures, failed "
        f"{failed}; the other thread ran {rounds} rounds, errors {errors[:2]}; worst {worst:.2e}"
    )
    assert not errors and rounds > 0
    assert not failed and runner.captured_sizes == tuple(gg.capture_sizes(64))
    runner.release()


@torch.inference_mode()
def test_a_host_sync_in_a_lazy_capture_fails_that_size_and_it_serves_eagerly():
    model = MLP()

    def step(x: torch.Tensor) -> torch.Tensor:
        if phase.current_phase() is Phase.CAPTURE and x.shape[0] == 8:
            float(x.sum())  # a host read while capturing
        return model(x)

    runner = gg.GraphRunner(
        step, (rand(2),), sizes=[4, 8, 16], lazy=True, progress=False, name="lazy-hostsync",
        state=[],
    )  # fmt: skip
    runner.capture()
    for n in (3, 7, 12, 3, 7, 12, 7):  # each size's first call, then its capture
        x = rand(n, seed=n)
        close(runner(x).clone(), model(x))
    row = runner.stats().size(8)
    say(f"host sync: size 8 {row.status}: {row.note}")
    assert runner.captured_sizes == (4, 16) and row.status == "failed"
    assert torch.cuda.get_sync_debug_mode() == 0  # never armed around a lazy capture


@torch.inference_mode()
def test_the_ledger_counts_the_driver_share_and_release_gives_it_back():
    model = MLP(layers=48)  # ~100 kernels a graph: a driver share worth measuring
    ladder = gg.capture_sizes(256)
    assert len(ladder) == 35
    runner = gg.GraphRunner(
        model, (rand(2),), sizes=ladder, progress=False, name="ledger", state=[]
    )
    # Every shape run once first: CUDA loads kernel modules lazily, at a kernel's first
    # launch, and that memory is not the graphs' (alone in a fresh process this test read
    # 184 MiB held against a 48 MiB ledger, eec97a6). Earlier eager GEMMs' cached cuBLAS
    # workspaces would be dropped by the capture (the pool's graphs own theirs) and show
    # up as memory given back: drop them, and what earlier tests left for the collector.
    for n in ladder:
        model(rand(n))
    gc.collect()
    drop_blas_workspaces()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    report = runner.capture()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warmups' cached blocks are not graph memory
    free1 = torch.cuda.mem_get_info()[0]
    held = free0 - free1
    ledger = runner.door.ledger.used
    runner.release()
    torch.cuda.synchronize()
    free2 = torch.cuda.mem_get_info()[0]
    say(
        f"ledger: 35 graphs hold {held / MIB:.1f} MiB of free memory; report pool "
        f"{report.pool_bytes / MIB:.1f} MiB + driver {report.driver_bytes / MIB:.1f} MiB = "
        f"ledger {ledger / MIB:.1f} MiB; release() gave back {(free2 - free1) / MIB:.1f} MiB"
    )
    # The driver's share shows as free memory gone, unless the driver serves it from what
    # it kept of graphs destroyed earlier in the process (release() below gives part of a
    # share back, part stays cached): after test_lazy_first_call_gpu.py's graphs it read
    # 0 with the pool alone held (eec97a6). Then the ledger must still equal the pool.
    assert report.driver_bytes > 0 or held <= report.pool_bytes + 2 * MIB, (held, report)
    assert abs(ledger - held) <= 0.10 * held + 4 * MIB, (ledger, held)
    # The pool comes back whole; the driver keeps part of a destroyed graph's share cached
    # (measured: 34 of 44 MiB back here, 86-100 % on bench/bench_pool.py's architectures).
    assert free2 - free1 >= 0.95 * report.pool_bytes, (free2 - free1, report.pool_bytes)
    assert runner.door.ledger.used == 0
