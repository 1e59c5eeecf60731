"""DistributedGraphRunner and the tensor-parallel model across processes, on gloo (CPU).

The multi-process tests share two worlds started together (2 and 3 processes, each on a
free localhost port, forked from one forkserver that imported torch once): each rank runs
every scenario of its world in order and writes what it saw to ``<tmp>/<world>/<rank>.json``;
the tests assert.
A scenario that hangs is killed after ``DEADLINE_S`` and fails the test (never a CI hang).
Captures use :class:`RecordingBackend`, whose replay re-runs the captured body, so the
gloo collectives inside the model really run at "replay" time.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphguard as gg
from graphguard.distributed import (
    BatchMismatchError,
    CapturePlanMismatchError,
    DistributedCaptureError,
    DistributedError,
    DistributedGraphRunner,
)
from graphguard_ref.demo.tp import free_port
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.tp import TensorParallelLlama, shard_config

DEADLINE_S = 45.0

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


# --------------------------------------------------------------------------- harness


def _child(rank: int, world: int, port: int, out_dir: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("graphguard")
    log.setLevel(logging.INFO)
    log.addHandler(_Keep())
    results: dict[str, Any] = {}
    for name in scenarios:
        records.clear()
        try:
            result = SCENARIOS[name](rank, world)
        except BaseException as exc:  # report, do not hide: the parent asserts on it
            result = {"unexpected": f"{type(exc).__name__}: {exc}"}
        result["log"] = list(records)
        results[name] = result
    Path(out_dir, f"{rank}.json").write_text(json.dumps(results, default=str))
    # A scenario that left a peer behind (timeouts) must not block in teardown.
    if not any(r.get("skip_destroy") for r in results.values()):
        dist.destroy_process_group()


def _spawn(worlds: dict[str, tuple[list[str], int]], out_dir: Path) -> dict[str, list[Any]]:
    """Run each world's scenarios in order in its own processes, every world at once (their
    timeout scenarios wait side by side); one result dict per rank, per world.

    The ranks fork from one forkserver that imported this module (and so torch) once:
    a rank costs a fork, not an interpreter importing torch."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    for name in worlds:
        (out_dir / name).mkdir()
    running = {
        name: mp.start_processes(
            _child,
            args=(world, free_port(), str(out_dir / name), scenarios),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        for name, (scenarios, world) in worlds.items()
    }
    deadline = time.monotonic() + DEADLINE_S
    try:
        for name, proc in running.items():
            while not proc.join(timeout=0.2):
                if time.monotonic() > deadline:
                    pytest.fail(f"{name}: {worlds[name][0]} did not finish in {DEADLINE_S} s")
    finally:
        for proc in running.values():
            for p in proc.processes:
                if p.is_alive():
                    p.kill()
    return {
        name: [json.loads((out_dir / name / f"{r}.json").read_text()) for r in range(world)]
        for name, (_, world) in worlds.items()
    }


# Order matters: scenarios that leave a peer behind (timeouts) run last.
TWO_RANKS = [
    "agree",
    "tp",
    "rank0_only",
    "options",
    "weights",
    "refit",
    "capture_failure",
    "lazy",
    "lazy_evict",
    "step_timeout",
    "canary",
]
THREE_RANKS = ["plan_mismatch", "missing_rank"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every multi-process scenario in two worlds started together (starting processes
    and waiting out timeouts is most of the cost)."""
    return _spawn(
        {"two": (TWO_RANKS, 2), "three": (THREE_RANKS, 3)}, tmp_path_factory.mktemp("ranks")
    )


@pytest.fixture(scope="module")
def two_ranks(worlds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return worlds["two"]


@pytest.fixture(scope="module")
def three_ranks(worlds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return worlds["three"]


def _results(per_rank: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    out = []
    for r, res in enumerate(per_rank):
        got = res[scenario]
        assert "unexpected" not in got, f"rank {r}: {got['unexpected']}"
        out.append(got)
    return out


def _sum_step(x: torch.Tensor) -> torch.Tensor:
    """A model step with a collective: every rank's rows summed (row i with row i)."""
    y = x.float() * 2
    dist.all_reduce(y)
    return y


def _runner(rank: int, **kw: Any) -> DistributedGraphRunner:
    kw.setdefault("sizes", [1, 2, 4, 8])
    kw.setdefault("backend", gg.RecordingBackend())
    kw.setdefault("timeout", 10.0)
    return DistributedGraphRunner(
        _sum_step, [torch.zeros(1, 3, dtype=torch.int64)], fill_values=100, **kw
    )


def _rows(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.int64).view(n, 3) + 1000 * (rank + 1)


# --------------------------------------------------------------------------- scenarios


def _scenario_agree(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pad = _runner(rank, on_mismatch="pad")
    pad.capture()
    # Same batch everywhere: the plain path.
    y = pad(_rows(rank, 3))
    out["same"] = y.tolist()
    # Rank 0 has 3 rows, rank 1 has 5: both replay the size-8 graph of 5 rows.
    n = 3 if rank == 0 else 5
    out["agreed"] = list(pad.agree_batch(n))
    y = pad(_rows(rank, n))
    out["pad_shape"] = list(y.shape)
    out["pad"] = y.tolist()
    # Above the largest captured size (8): eager on every rank, still padded to match.
    n = 9 if rank == 0 else 11
    y = pad(_rows(rank, n))
    out["eager_pad_shape"] = list(y.shape)
    out["eager_pad"] = y.tolist()
    # on_mismatch="raise": every rank raises, naming every rank's size.
    strict = _runner(rank)
    strict.capture()
    try:
        strict(_rows(rank, 2 if rank == 0 else 4))
    except BatchMismatchError as exc:
        out["raise"] = {"sizes": exc.sizes, "msg": str(exc), "ranks": list(exc.ranks)}
    # ...and stays usable: the next agreeing step runs.
    out["after"] = strict(_rows(rank, 2)).tolist()
    out["capture_times"] = sorted(strict.capture_times)
    # recapture on every rank: the same ladder again, the same results.
    out["recaptured"] = list(strict.recapture(reason="test").captured)
    out["after_recapture"] = strict(_rows(rank, 2)).tolist()
    # Invalid inputs on one rank: every rank raises, none runs the step.
    bad = _rows(rank, 2).float() if rank == 1 else _rows(rank, 2)
    try:
        strict(bad)
    except DistributedError as exc:
        out["invalid"] = {"ranks": list(exc.ranks), "msg": str(exc)}
    return out


def _scenario_plan_mismatch(rank: int, world: int) -> dict[str, Any]:
    sizes = [1, 2, 4, 8, 16] if rank == 2 else [1, 2, 4, 8]
    runner = _runner(rank, sizes=sizes)
    try:
        runner.capture()
    except CapturePlanMismatchError as exc:
        return {"ranks": list(exc.ranks), "msg": str(exc), "captured": list(runner.captured_sizes)}
    return {"ranks": None}


def _tp_models(rank: int, world: int) -> tuple[LlamaDecodeModel, TensorParallelLlama]:
    cfg = LlamaConfig.preset("tiny", max_batch=8, max_context=32)
    full = LlamaDecodeModel.random(cfg, seed=0, overlap=False)
    tp = TensorParallelLlama.random_sharded(cfg, seed=0, overlap=False)
    return full, tp


def _scenario_tp(rank: int, world: int) -> dict[str, Any]:
    full, tp = _tp_models(rank, world)
    eager = DistributedGraphRunner(
        tp.decode_step,
        tp.example_inputs(1),
        sizes=[1, 2, 4, 8],
        mode="none",
        fill_values=tp.pad_fill_values(),
        timeout=10.0,
    )
    eager.capture()
    graphs = DistributedGraphRunner(
        tp.decode_step,
        tp.example_inputs(1),
        sizes=[1, 2, 4, 8],
        fill_values=tp.pad_fill_values(),
        before_capture=[tp.warm_kernels],
        workspaces=[tp.workspace],
        backend=gg.RecordingBackend(),
        timeout=10.0,
    )
    graphs.capture()
    gen = torch.Generator().manual_seed(7)
    worst_tp, worst_graph, steps = 0.0, 0.0, 0
    for b in (3, 3, 1, 8, 5, 2, 6, 1):
        inp = full.example_inputs(b, generator=gen)  # same generator stream on every rank
        ref = full.decode_step(*inp)
        got = eager(*inp)
        worst_tp = max(worst_tp, float((got - ref).abs().max()))
        replayed = graphs(*inp)
        worst_graph = max(worst_graph, float((replayed - got).abs().max()))
        steps += 1
    return {
        "worst_tp": worst_tp,
        "worst_graph": worst_graph,
        "steps": steps,
        "local_heads": tp.config.num_heads,
        "local_kv_heads": tp.config.num_kv_heads,
    }


def _scenario_rank0_only(rank: int, world: int) -> dict[str, Any]:
    lines: list[str] = []
    runner = _runner(rank, progress=True)
    runner.capture()
    runner.log_report(lines.append)
    return {"progress": runner.runner.options.progress, "report_lines": len(lines)}


def _scenario_options(rank: int, world: int) -> dict[str, Any]:
    """What the caller set in a shared options object arrives unchanged; the wrapper's
    own defaults fill only what was left unset."""
    shared = gg.CaptureOptions(
        sizes=[1, 2],
        capture_error_mode="global",
        progress=False,
        name="mystep",
        warmup_iters=2,
        output_batch_dims=0,
    )
    given = DistributedGraphRunner(
        _sum_step,
        [torch.zeros(1, 3, dtype=torch.int64)],
        options=shared,
        backend=gg.RecordingBackend(),
        timeout=10.0,
    )
    unset = _runner(rank)
    given.capture()
    out = given(_rows(rank, 2))
    o = given.runner.options
    return {
        "given": [o.capture_error_mode, o.progress, given.name, o.warmup_iters, list(o.sizes)],
        "dims": [o.output_batch_dims, given.runner._store.layout.dims],
        "unset": [unset.runner.options.capture_error_mode, unset.runner.options.progress],
        "out": out.tolist(),
    }


def _scenario_capture_failure(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for warmup_iters in (1, 0):
        backend = gg.RecordingBackend()
        if rank == 1:
            backend.fail_on = {4}
        runner = DistributedGraphRunner(
            lambda x: x * 2,
            [torch.zeros(1, 3)],
            sizes=[1, 2, 4, 8],
            backend=backend,
            timeout=10.0,
            options=gg.CaptureOptions(warmup_iters=warmup_iters),
        )
        try:
            runner.capture()
            out[str(warmup_iters)] = None
        except DistributedCaptureError as exc:
            out[str(warmup_iters)] = {
                "failures": {str(k): v[0] for k, v in exc.failures.items()},
                "msg": str(exc),
                "captured": list(runner.captured_sizes),
                "is_capture_error": isinstance(exc, gg.errors.GraphCaptureError),
            }
    return out


def _scenario_missing_rank(rank: int, world: int) -> dict[str, Any]:
    runner = _runner(rank, timeout=2.0)  # construction is collective: every rank
    if rank == 2:
        time.sleep(4.0)  # never calls capture(); exits after its peers gave up
        return {"skip_destroy": True}
    t0 = time.monotonic()
    try:
        runner.capture()
    except DistributedError as exc:
        return {
            "ranks": list(exc.ranks),
            "msg": str(exc),
            "waited": time.monotonic() - t0,
            "skip_destroy": True,
        }
    return {"ranks": None, "skip_destroy": True}


def _scenario_step_timeout(rank: int, world: int) -> dict[str, Any]:
    runner = _runner(rank, timeout=2.0, mode="none")
    runner.capture()
    if rank == 1:
        time.sleep(4.0)  # skips the step its peer runs
        return {"skip_destroy": True}
    try:
        runner(_rows(rank, 2))
    except DistributedError as exc:
        return {"rank": exc.rank, "msg": str(exc), "skip_destroy": True}
    return {"rank": None, "skip_destroy": True}


class _Scaled(torch.nn.Module):
    """One weight per rank (its shard) and a collective: y = sum over ranks of x * w."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), float(rank + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * self.w
        dist.all_reduce(y)
        return y


def _scenario_weights(rank: int, world: int) -> dict[str, Any]:
    from graphguard.errors import WeightsMovedError

    out: dict[str, Any] = {}
    model = _Scaled(rank)
    r = DistributedGraphRunner(
        model,
        [torch.zeros(1, 3, dtype=torch.int64)],
        sizes=[1, 2],
        backend=gg.RecordingBackend(),
        timeout=10.0,
    )
    r.capture()
    x = _rows(rank, 2)
    # A wrong shard on rank 1: every rank refuses before any rank copies.
    try:
        r.update_weights({"w": torch.zeros(4) if rank == 1 else torch.full((3,), 9.0)})
    except DistributedError as exc:
        out["bad"] = {"ranks": list(exc.ranks), "msg": str(exc)}
    out["w_after_bad"] = model.w.tolist()
    up = r.update_weights({"w": torch.full((3,), 10.0 * (rank + 1))})
    out["copied"] = list(up.copied)
    out["w"] = model.w.tolist()
    out["y"], out["eager"] = r(x).tolist(), r.eager(x).tolist()

    # Rank 0's loader rebinds its weight: raised on every rank, then recaptured on every rank.
    def loader() -> None:
        if rank == 0:
            model.w = torch.nn.Parameter(model.w.detach() + 1)

    try:
        r.update_weights(loader, strict=False)  # strict=False: a loader writing nothing
    except (WeightsMovedError, DistributedError) as exc:
        out["moved"] = type(exc).__name__
    up = r.update_weights(lambda: None, on_moved="recapture", strict=False)
    out["recaptured"] = [list(v) for v in up.recaptured.values()]
    out["ok"] = r.check_weights().ok
    out["y2"], out["eager2"] = r(x).tolist(), r.eager(x).tolist()
    return out


def _scenario_refit(rank: int, world: int) -> dict[str, Any]:
    """``with r.refit():`` on both ranks (issue 40): rank 1's loader skips its shard, so
    every rank refuses; then both write theirs and both verdicts are clean."""
    from graphguard.errors import StaleWeightsError

    out: dict[str, Any] = {}
    model = _Scaled(rank)
    r = DistributedGraphRunner(
        model,
        [torch.zeros(1, 3, dtype=torch.int64)],
        sizes=[1, 2],
        backend=gg.RecordingBackend(),
        timeout=10.0,
    )
    r.capture()
    try:
        with r.refit(), torch.no_grad():
            if rank == 0:
                model.w.copy_(torch.full((3,), 5.0))
    except (StaleWeightsError, DistributedError) as exc:
        out["stale"] = type(exc).__name__
        out["msg"] = str(exc)[:300]
    with r.refit() as done, torch.no_grad():
        model.w.copy_(torch.full((3,), 7.0 * (rank + 1)))
    out["ok"] = bool(done.verdict is not None and done.verdict.ok)
    x = _rows(rank, 2)
    out["y"], out["eager"] = r(x).tolist(), r.eager(x).tolist()
    return out


def _scenario_canary(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's step freezes a per-shape number after its collective (rank 0's is
    correct): both ranks check the same calls, both run the eager collective, and rank 0
    goes eager with rank 1 on rank 1's divergence."""
    frozen: dict[tuple[int, ...], float] = {}
    host = {"scale": 1.0}

    def step(x: torch.Tensor) -> torch.Tensor:
        y = _sum_step(x)
        return y * frozen.setdefault(tuple(x.shape), host["scale"]) if rank == 1 else y

    r = DistributedGraphRunner(
        step,
        [torch.zeros(1, 3, dtype=torch.int64)],
        sizes=[2, 4],
        fill_values=100,
        backend=gg.RecordingBackend(),
        timeout=10.0,
        state=[],
        canary=gg.Canary(every=2, on_divergence="eager"),
    )
    r.capture()
    host["scale"] = 3.0
    ys = [r(_rows(rank, 3)).tolist() for _ in range(3)]
    st = r.canary_stats()[4]
    note = st.last.sizes[0].note if st.last is not None else None
    return {"ys": ys, "checks": st.checks, "div": st.divergences, "eager": st.eager, "note": note}


def _scenario_lazy(rank: int, world: int) -> dict[str, Any]:
    """Lazy capture on both ranks: random batch sizes (the same on both), each size captured
    in the same call everywhere; rank 1's capture of size 4 fails after recording (an
    instantiation OOM), so both ranks drop 4 and pad past it; every result equals eager."""
    be = gg.RecordingBackend()
    if rank == 1:
        real = be.capture

        def failing(body: Any, **kw: Any) -> Any:
            captured = real(body, **kw)
            if kw.get("label") == 4:
                raise torch.OutOfMemoryError("emulated instantiation OOM at size 4")
            return captured

        be.capture = failing  # type: ignore[method-assign]
    r = _runner(rank, lazy=True, backend=be, state=[])
    r.capture()
    g = torch.Generator().manual_seed(7)
    equal, sizes = True, []
    for _ in range(40):
        n = int(torch.randint(1, 11, (1,), generator=g))
        sizes.append(n)
        x = _rows(rank, n)
        y = r(x).clone()
        want = r.eager(x)  # elementwise with a sum across ranks: bitwise at any padding
        equal = equal and torch.equal(y, want)
    st = r.stats()
    return {
        "equal": equal,
        "saw": sorted(set(sizes)),
        "captured": list(r.captured_sizes),
        "refused": {s.size: s.status for s in st.sizes if s.status in ("failed", "over budget")},
        "labels": [e[1] for e in be.events if e[0] == "capture_begin"],
        "eager": st.eager_calls,
        "replays": st.replays,
    }


def _scenario_lazy_evict(rank: int, world: int) -> dict[str, Any]:
    """Issue 41 under tensor parallelism. Rank 1's graphs take twice rank 0's driver share,
    so alone the ranks would evict different graphs at different calls; they agree on
    each. Rank 1's first call at size 2 raises after its collective: the call fails on
    both ranks, nothing is kept, and the next call at 2 is its first call on both."""
    share = (rank + 1) << 20
    be = gg.RecordingBackend(graph_bytes=lambda label: (int(label) << 20, share))
    armed = [rank == 1]

    def step(x: torch.Tensor) -> torch.Tensor:
        y = _sum_step(x)
        if armed[0] and x.shape[0] == 2 and gg.phase.is_first_call():
            armed[0] = False
            raise RuntimeError("planted first-call failure on rank 1")
        return y

    r = DistributedGraphRunner(
        step, [torch.zeros(1, 3, dtype=torch.int64)], fill_values=100, sizes=[1, 2, 4, 8],
        backend=be, timeout=10.0, state=[], lazy=gg.Lazy(budget=12 << 20, evict="lru"),
    )  # fmt: skip
    r.capture()
    equal = True
    for n in (8, 8, 1, 1, 4, 4, 8):
        x = _rows(rank, n)
        equal = equal and torch.equal(r(x).clone(), r.eager(x))
    try:
        r(_rows(rank, 2))
        failed = "none"
    except Exception as exc:
        failed = type(exc).__name__
    st = r.stats()
    after_failure = st.size(2).status
    for _ in range(2):
        x = _rows(rank, 2)
        equal = equal and torch.equal(r(x).clone(), r.eager(x))
    st = r.stats()
    return {
        "equal": equal,
        "failed": failed,
        "after_failure": after_failure,
        "labels": [e[1] for e in be.events if e[0] == "capture_begin"],
        "captured": list(r.captured_sizes),
        "evictions": {s.size: s.evictions for s in st.sizes if s.evictions},
        "used": r.runner.door.ledger.used,
    }


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "lazy": _scenario_lazy,
    "lazy_evict": _scenario_lazy_evict,
    "canary": _scenario_canary,
    "agree": _scenario_agree,
    "plan_mismatch": _scenario_plan_mismatch,
    "tp": _scenario_tp,
    "rank0_only": _scenario_rank0_only,
    "options": _scenario_options,
    "weights": _scenario_weights,
    "refit": _scenario_refit,
    "capture_failure": _scenario_capture_failure,
    "missing_rank": _scenario_missing_rank,
    "step_timeout": _scenario_step_timeout,
}


# --------------------------------------------------------------------------- tests


def test_ranks_agree_on_the_batch_pad_or_raise(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = _results(two_ranks, "agree")
    x0, x1 = _rows(0, 8), _rows(1, 8)
    fill = torch.full((8, 3), 100)
    # Equal batches: each row is 2 * (rank 0's row + rank 1's row).
    assert r0["same"] == r1["same"] == (2 * (x0[:3] + x1[:3])).float().tolist()
    assert r0["agreed"] == r1["agreed"] == [3, 5]
    # pad: rank 0's rows 3..4 are fill values in the replayed size-8 graph.
    expect5 = (2 * (torch.cat([x0[:3], fill[:2]]) + x1[:5])).float()
    assert r0["pad_shape"] == [3, 3] and r1["pad_shape"] == [5, 3]
    assert r0["pad"] == expect5[:3].tolist()
    assert r1["pad"] == expect5.tolist()
    # Above the ladder: eager, padded to 11 on every rank.
    y0, y1 = _rows(0, 11), _rows(1, 11)
    expect11 = (2 * (torch.cat([y0[:9], torch.full((2, 3), 100)]) + y1)).float()
    assert r0["eager_pad_shape"] == [9, 3] and r1["eager_pad_shape"] == [11, 3]
    assert r0["eager_pad"] == expect11[:9].tolist() and r1["eager_pad"] == expect11.tolist()
    # raise: both ranks, both sizes named.
    for r in (r0, r1):
        assert r["raise"]["sizes"] == {"0": 2, "1": 4}
        assert "rank 0: 2, rank 1: 4" in r["raise"]["msg"]
        assert r["raise"]["ranks"] == [1]
        assert r["invalid"]["ranks"] == [1]
    assert r0["raise"]["msg"].startswith("rank 0:") and r1["raise"]["msg"].startswith("rank 1:")
    assert "mine:" in r1["invalid"]["msg"] and "dtype" in r1["invalid"]["msg"]
    assert r0["after"] == (2 * (x0[:2] + x1[:2])).float().tolist()
    assert r0["after_recapture"] == r0["after"]
    for r in (r0, r1):
        assert r["recaptured"] == [1, 2, 4, 8]
        assert r["capture_times"] == ["agree_after_s", "agree_before_s", "ladder_s"]


def test_plan_mismatch_is_an_error_naming_ranks_and_sizes(
    three_ranks: list[dict[str, Any]],
) -> None:
    results = _results(three_ranks, "plan_mismatch")
    for rank, res in enumerate(results):
        assert res["ranks"] == [2]
        assert res["msg"].startswith(f"rank {rank}:")
        assert "rank 2: sizes [16, 8, 4, 2, 1]" in res["msg"]
        assert "rank 0: sizes [8, 4, 2, 1]" in res["msg"]
        assert res["captured"] == []


def test_tp_model_equals_single_process_model_and_replay_equals_eager(
    two_ranks: list[dict[str, Any]],
) -> None:
    results = _results(two_ranks, "tp")
    for res in results:
        assert res["local_heads"] == 2 and res["local_kv_heads"] == 1
        assert res["steps"] == 8
        # Row-parallel sums change the summation order only: fp32 rounding.
        assert res["worst_tp"] < 1e-5
        # Replay runs the padded size (a different GEMM M): fp32 rounding again.
        assert res["worst_graph"] < 1e-5


def test_progress_bar_and_report_on_rank0_only(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = _results(two_ranks, "rank0_only")
    assert r0["progress"] is True and r1["progress"] is False
    assert r0["report_lines"] == 1 and r1["report_lines"] == 0
    assert any(line.startswith("rank 0:") for line in r0["log"])
    assert r1["log"] == []  # INFO lines of capture stay on rank 0


def test_options_pass_through_the_wrapper_unchanged(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = _results(two_ranks, "options")
    for r in (r0, r1):
        assert r["given"] == ["global", False, "mystep", 2, [1, 2]]
        assert r["dims"] == [0, [0]]  # declared, and checked against the step's output
    # Unset: the wrapper's defaults (thread_local; the bar on the first rank only).
    assert r0["unset"] == ["thread_local", True] and r1["unset"] == ["thread_local", False]
    expected = (_rows(0, 2).float() * 2 + _rows(1, 2).float() * 2).tolist()
    assert r0["out"] == r1["out"] == expected


def test_weight_shards_update_on_every_rank_or_on_none(two_ranks: list[dict[str, Any]]) -> None:
    """Each rank loads its own shard; a bad shard on one rank changes no rank's weights;
    a tensor moved on one rank is raised on every rank, and recaptured on every rank."""
    results = _results(two_ranks, "weights")
    for rank, res in enumerate(results):
        assert res["bad"]["ranks"] == [1] and "w: expected float32 [3]" in res["bad"]["msg"]
        assert res["w_after_bad"] == [float(rank + 1)] * 3
        assert res["copied"] == ["w"] and res["w"] == [10.0 * (rank + 1)] * 3
        assert res["y"] == res["eager"]
        assert res["recaptured"] == [[1, 2]] and res["ok"]
        assert res["y2"] == res["eager2"]
    assert [res["moved"] for res in results] == ["WeightsMovedError", "DistributedError"]


def test_a_refit_one_rank_left_stale_is_refused_on_every_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    results = _results(two_ranks, "refit")
    assert [res["stale"] for res in results] == ["DistributedError", "StaleWeightsError"]
    assert "rank(s) [1]" in results[0]["msg"] and "w (parameter)" in results[1]["msg"]
    for res in results:
        assert res["ok"] and res["y"] == res["eager"]


def test_capture_failure_on_one_rank_is_raised_on_every_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    # warmup_iters=1: reported at the peers' next per-size check-in; 0: at the final one.
    for res in _results(two_ranks, "capture_failure"):
        for key in ("1", "0"):
            info = res[key]
            assert info is not None, key
            assert info["failures"] == {"1": 4}
            assert "rank 1 at size 4" in info["msg"]
            assert info["captured"] == []  # released on every rank
            assert info["is_capture_error"]


def test_a_rank_that_never_arrives_is_named_not_a_hang(three_ranks: list[dict[str, Any]]) -> None:
    r0, r1, _ = _results(three_ranks, "missing_rank")
    assert r0["ranks"] == [2] and "Ranks 2 failed" in r0["msg"]
    assert r1["ranks"] is not None and r1["msg"].startswith("rank 1:")
    assert r0["waited"] < 10


def test_a_rank_that_skips_a_step_is_an_error_not_a_hang(two_ranks: list[dict[str, Any]]) -> None:
    r0, _ = _results(two_ranks, "step_timeout")
    assert r0["rank"] == 0
    assert "did not arrive within 2 s" in r0["msg"]


# --------------------------------------------------------------------------- one process


def test_lazy_capture_is_collective_and_a_failure_on_one_rank_is_eager_everywhere(
    two_ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = _results(two_ranks, "lazy")
    for res in (r0, r1):
        assert res["equal"]
        assert res["refused"] == {"4": "failed"}
        assert 4 not in res["captured"] and res["captured"] == r0["captured"]
    # Every rank captured the same sizes in the same calls (4 too: it failed at the end).
    assert r0["labels"] == r1["labels"] and 4 in r0["labels"]
    assert (r0["eager"], r0["replays"]) == (r1["eager"], r1["replays"])
    assert any(n > 8 for n in r0["saw"]) and r0["eager"] > 0


def test_ranks_evict_the_same_graphs_and_fail_a_first_call_together(
    two_ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = _results(two_ranks, "lazy_evict")
    assert r0["equal"] and r1["equal"]
    assert (r0["failed"], r1["failed"]) == ("GraphGuardError", "RuntimeError")
    assert r0["after_failure"] == r1["after_failure"] == "pending"  # nothing kept
    for key in ("labels", "captured", "evictions"):
        assert r0[key] == r1[key], key
    assert r0["evictions"] and r0["used"] < r1["used"] <= 12 << 20


def test_needs_torch_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(gg.errors.ConfigError, match="init_process_group"):
        DistributedGraphRunner(_sum_step, [torch.zeros(1, 3)])


def test_shard_config_divisibility() -> None:
    cfg = LlamaConfig.preset("tiny")
    assert shard_config(cfg, 2).num_heads == 2
    with pytest.raises(gg.errors.ConfigError, match="num_heads=4, num_kv_heads=2"):
        shard_config(cfg, 3)


def test_tp_size_one_without_a_group_is_the_plain_model() -> None:
    cfg = LlamaConfig.preset("tiny", max_batch=8)
    full = LlamaDecodeModel.random(cfg, seed=0)
    tp = TensorParallelLlama.random_sharded(cfg, seed=0)
    inp = full.example_inputs(5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(full.decode_step(*inp), tp.decode_step(*inp))
    with pytest.raises(NotImplementedError, match="from_full"):
        tp.hf_weight_views()


@pytest.fixture
def world1(tmp_path: Path) -> Any:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_world_of_one_captures_and_replays(world1: None) -> None:
    with pytest.raises(gg.errors.ConfigError, match="on_capture_error='raise'"):
        _runner(0, options=gg.CaptureOptions(on_capture_error="skip"))
    with pytest.raises(gg.errors.ConfigError, match="agree must be"):
        _runner(0, agree="sometimes")
    for agree in ("allreduce", "trust"):
        runner = _runner(0, agree=agree)
        report = runner.capture()
        assert report.captured == [1, 2, 4, 8]
        assert runner.capture_signature()["sizes"] == [8, 4, 2, 1]
        x = _rows(0, 3)
        y = runner(x)  # elementwise: the padded replay is bitwise the unpadded arithmetic
        assert torch.equal(y, (2 * x).float())
        assert runner.padded_size(3) == 4
        assert "rank 0" in repr(runner)
        runner.release()
        assert runner.captured_sizes == ()


def test_hot_path_cost_is_one_small_cpu_all_reduce(world1: None) -> None:
    runner = _runner(0, mode="none")
    runner.capture()
    assert runner.agree_batch(5) == (5, 5)
    assert runner._agree_buf.device.type == "cpu"
    assert os.environ.get("GRAPHGUARD_SANITIZE", "") in ("", "0")


def test_rank_log_prefix_touches_only_the_capturing_threads_records() -> None:
    """The rank filter sits on the shared 'graphguard' logger; another thread's records pass
    through unchanged (no prefix, not dropped)."""
    import logging
    import threading

    from graphguard._ranks import rank_logging

    seen: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.threadName or "", record.getMessage()))

    log = logging.getLogger("graphguard")
    handler = Keep(level=logging.DEBUG)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with rank_logging(1):
            log.info("capture detail")  # rank 1, INFO: dropped
            log.warning("capture warning")  # rank 1: prefixed
            t = threading.Thread(target=lambda: log.info("server line"), name="server")
            t.start()
            t.join()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    msgs = [m for _, m in seen]
    assert "rank 1: capture warning" in msgs
    assert "capture detail" not in msgs and "rank 1: capture detail" not in msgs
    assert ("server", "server line") in seen


def test_canary_checks_the_same_calls_on_every_rank_and_agrees_on_divergence(
    two_ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = _results(two_ranks, "canary")
    assert (r0["checks"], r0["div"], r0["eager"]) == (r1["checks"], r1["div"], r1["eager"])
    assert (r0["checks"], r0["div"], r0["eager"]) == (1, 1, True)
    assert r0["note"] == "another rank diverged"
    want = (2 * (_rows(0, 3) + _rows(1, 3))).float()
    assert r0["ys"][1] == r0["ys"][2] == want.tolist()  # rank 0 was right all along
    assert r1["ys"][1] == r1["ys"][2] == (want * 3).tolist()  # eager: the host's scale


def test_the_provenance_environment_switch_reaches_the_rank_runner(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRAPHGUARD_PROVENANCE means what it means for GraphRunner: on where ``provenance``
    is left unset, off with ``provenance=False``."""
    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "1")
    for option, on in ((None, True), (False, False)):
        runner = _runner(0, provenance=option)
        runner.capture()
        assert runner.runner.audit().enabled is on
        runner.release()


def test_the_layout_probes_forwards_stand_for_the_rank_runners_first_warmups(
    world1: None,
) -> None:
    """As for GraphRunner: up front, the probe's forward at the two largest sizes is their
    first warmup, except the first size's, watched for undeclared writes (no ``state=``);
    with ``state=`` declared both are."""
    cases: list[tuple[dict[str, Any], list[bool]]] = [
        ({}, [False, True, False, False]),
        ({"state": []}, [True, True, False, False]),
    ]
    for kw, want in cases:
        runner = _runner(0, **kw)
        report = runner.capture()
        assert [s.size for s in report.sizes] == [8, 4, 2, 1]
        assert [s.prewarmed for s in report.sizes] == want
        assert [s.warmups for s in report.sizes] == [0 if p else 1 for p in want]
        runner.release()
