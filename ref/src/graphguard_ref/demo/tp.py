"""``graphguard-demo --tp N``: the decode demo with an N-way tensor-parallel model.

Contract: under ``torchrun`` (``WORLD_SIZE`` set) it runs as this process's rank;
otherwise it spawns ``N`` processes on this host (one GPU each; without CUDA, gloo on
the CPU with the tiny preset, eagerly in mode none). Every rank checks its graph
logits against its eager logits on every step; rank 0 prints and returns the result dict.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphguard.distributed import DistributedGraphRunner
from graphguard.errors import ConfigError
from graphguard.sizes import capture_sizes
from graphguard_ref.demo.common import (
    DEFAULT_PHASES,
    Sequences,
    batch_schedule,
    check_decode_loop,
    time_decode_loop,
    write_json,
)
from graphguard_ref.llama import LlamaConfig
from graphguard_ref.tp import TensorParallelLlama


def free_port() -> int:
    """A free localhost TCP port for a rendezvous (racy in theory, fine for a demo/tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp_demo(
    tp: int,
    *,
    preset: str | None = None,
    max_batch: int = 256,
    max_context: int = 1024,
    sizes: Sequence[int] | None = None,
    steps: int = 400,
    phases: Sequence[int] | None = None,
    mode: str = "full",
    json_path: Path | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """``graphguard-demo --tp N``: the decode demo with an N-way tensor-parallel model.

    Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` set) it runs as this process's
    rank. Otherwise it starts ``tp`` processes itself on this host (one GPU each; on a
    machine without CUDA, gloo on the CPU with the tiny preset, eagerly), so
    ``graphguard-demo --tp 2`` works on a 2-GPU box without a launcher. Rank 0 prints
    and returns the result dict (other ranks return None); every rank checks its graph
    logits against its eager logits on every step.
    """
    kwargs: dict[str, Any] = {
        "preset": preset,
        "max_batch": max_batch,
        "max_context": max_context,
        "sizes": list(sizes) if sizes else None,
        "steps": steps,
        "phases": list(phases) if phases else None,
        "mode": mode,
        "json_path": str(json_path) if json_path else None,
    }
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ConfigError(f"--tp {tp}, but torchrun started {world} processes")
        return _tp_demo_rank(int(os.environ["RANK"]), tp, None, kwargs, out)
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        raise ConfigError(
            f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}"
        )
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_tp_demo_child, args=(rank, tp, port, kwargs, results))
        for rank in range(tp)
    ]
    for p in procs:
        p.start()
    result: dict[str, Any] | None = None
    failed = []
    for p in procs:
        p.join()
        if p.exitcode != 0:
            failed.append(p.exitcode)
    while not results.empty():
        kind, payload = results.get()
        if kind == "result":
            result = payload
        else:
            out(payload)
    if failed:
        raise RuntimeError(f"graphguard-demo --tp {tp}: {len(failed)} rank(s) failed")
    if result is not None:
        for line in result.pop("lines", []):
            out(line)
    return result


def _tp_demo_child(
    rank: int, tp: int, port: int, kwargs: dict[str, Any], results: Any
) -> None:  # pragma: no cover - runs in a child process
    lines: list[str] = []
    try:
        res = _tp_demo_rank(rank, tp, port, kwargs, lines.append)
    except BaseException as exc:
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    if res is not None:
        res["lines"] = lines
        results.put(("result", res))


def _tp_demo_rank(
    rank: int,
    tp: int,
    port: int | None,
    kwargs: dict[str, Any],
    out: Callable[[str], None],
) -> dict[str, Any] | None:
    """One rank of the TP demo: init, build the shard, capture, check, time."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    init_kwargs: dict[str, Any] = {}
    if cuda:
        init_kwargs["device_id"] = device
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init,
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=120),
        **init_kwargs,
    )
    say = out if rank == 0 else (lambda _line: None)
    try:
        preset = kwargs["preset"] or ("llama-1b" if cuda else "tiny")
        mode = kwargs["mode"] if cuda else "none"
        if not cuda:
            say(
                "No CUDA device: running the tensor-parallel loop on gloo ranks eagerly (mode "
                "none), on the 'tiny' preset: this shows the sharded model and the ranks "
                "agreeing on every batch; graphs of collectives need GPUs"
            )
        dtype = torch.bfloat16 if cuda else torch.float32
        cfg = LlamaConfig.preset(
            preset, max_batch=kwargs["max_batch"], max_context=kwargs["max_context"]
        )
        model = TensorParallelLlama.random_sharded(cfg, device=device, dtype=dtype, seed=0)
        say(
            f"model: {preset} over {tp} ranks ({model.config.num_heads} heads, "
            f"{model.config.num_kv_heads} KV heads per rank), {dtype}, on {device.type}"
        )
        ladder = kwargs["sizes"] or capture_sizes(cfg.max_batch)
        runner = DistributedGraphRunner(
            model.decode_step,
            model.example_inputs(1),
            sizes=ladder,
            mode=mode,
            fill_values=model.pad_fill_values(),
            names=("token_ids", "positions", "slots"),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            name=f"{preset}.tp{tp}.decode_step",
            state=[],  # capture writes the KV cache only at the scratch slot
            progress=cuda and rank == 0,
        )
        with torch.inference_mode():
            runner.capture()
            runner.log_report(say)
            phases = kwargs["phases"] or DEFAULT_PHASES
            schedule = batch_schedule(kwargs["steps"], phases, cfg.max_batch)
            gen = torch.Generator(device=device).manual_seed(1)
            first = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), device=device, generator=gen)
            model.reset_cache()
            seqs = Sequences(cfg.max_batch, cfg.max_context, device)
            check = {
                "rank": rank,
                **check_decode_loop(runner, model.decode_step, schedule, seqs, first),
            }
            checks: list[Any] = [None] * tp
            dist.all_gather_object(checks, check, group=runner.control_group)
            # Mode none captures nothing: the runner's calls are eager too, and the line
            # says so instead of claiming a graph.
            compared = (
                "graph vs eager"
                if mode != "none"
                else "runner (mode none: eager, no graph) vs the model called directly"
            )
            for c in checks:
                say(
                    f"rank {c['rank']}: {compared} over {c['steps']} steps: "
                    f"{c['bitwise_equal_steps']} bitwise equal, argmax agreement "
                    f"{100 * c['argmax_agreement']:.2f}%, max |diff| {c['max_abs_logit_diff']:.3g}"
                )
            per_batch: list[dict[str, float]] = []
            if cuda:
                times: dict[str, dict[int, list[float]]] = {}
                for label, fn in (("graphguard", runner), ("eager", model.decode_step)):
                    model.reset_cache()
                    seqs = Sequences(cfg.max_batch, cfg.max_context, device)
                    times[label] = time_decode_loop(fn, schedule, seqs, first)
                say(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
                for b in sorted(times["eager"]):
                    e_ms = statistics.median(times["eager"][b])
                    g_ms = statistics.median(times["graphguard"][b])
                    per_batch.append({"batch": b, "eager_ms": e_ms, "graphguard_ms": g_ms})
                    say(f"{b:>6} {e_ms:>9.3f} {g_ms:>9.3f} {e_ms / g_ms:>7.2f}x")
        runner.release()
        result = {
            "tp": tp,
            "preset": preset,
            "mode": mode,
            "device": str(device.type),
            "checks": checks,
            "per_batch": per_batch,
        }
        if rank == 0 and kwargs["json_path"]:
            write_json(result, Path(kwargs["json_path"]), say)
        # Every rank done before any tears down: gloo's pair threads abort the process
        # ("terminate called without an active exception") when a peer closes a pair
        # that still has a send in flight, which a loaded CI machine showed. On the
        # success path only: a failed rank must not wait for peers stuck elsewhere.
        dist.barrier()
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = ["free_port", "run_tp_demo"]
