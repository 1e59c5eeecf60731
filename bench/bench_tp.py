"""Tensor-parallel decode through DistributedGraphRunner: correctness on every rank, timing.

Launch with torchrun (``bash scripts/run_tp.sh N``), one process per GPU. Every rank:

1. builds its shard of the seeded reference model (``--preset``, bf16), captures the
   ladder through :class:`graphguard.distributed.DistributedGraphRunner` (NCCL
   all-reduces inside the graphs);
2. runs ``--steps`` (>= 500) decode steps through batch-size transitions (``--phases``),
   each step replayed and then run eagerly on the same state: bitwise-equal steps, max
   |logit diff| and argmax agreement per rank;
3. times eager vs graphguard per batch size (CUDA events, median of ``--reps``), and the
   host cost of the per-step batch agreement (``agree_us``).

Rank 0 writes ``<out>/tp<N>_<gpu>_<date>.json`` with every rank's numbers. Exit status
1 when a rank's graphs disagree with its eager run (argmax or a captured size not
bitwise equal).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphguard.distributed import DistributedGraphRunner
from graphguard.sizes import capture_sizes
from graphguard_ref.demo import Sequences, batch_schedule
from graphguard_ref.llama import LlamaConfig
from graphguard_ref.timing import isolated_ms
from graphguard_ref.tp import TensorParallelLlama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--phases", default="8,1,37,256,3,64", help="batch sizes to move through")
    ap.add_argument("--batches", default="1,4,16,64,256", help="batch sizes to time")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument(
        "--cold",
        action="store_true",
        help="capture first thing (no eager step at max batch before it)",
    )
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=device)
    say = print if rank == 0 else (lambda *_a, **_k: None)
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    say(f"tp={world}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, env {nccl_env}")

    cfg = LlamaConfig.preset(args.preset, max_batch=args.max_batch, max_context=args.context)
    t0 = time.perf_counter()
    model = TensorParallelLlama.random_sharded(cfg, device=device, dtype=torch.bfloat16, seed=0)
    build_s = time.perf_counter() - t0
    ladder = capture_sizes(cfg.max_batch)
    runner = DistributedGraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=ladder,
        fill_values=model.pad_fill_values(),
        names=("token_ids", "positions", "slots"),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        name=f"{args.preset}.tp{world}",
        timeout=300.0,
    )
    result: dict[str, Any] = {}
    with torch.inference_mode():
        # What a serving engine does before capturing (a profiling forward at the
        # largest batch): the process's first collective at a real size, cuBLAS and
        # NCCL first-use setup. Timed apart so the capture below is the ladder's own cost.
        t0 = time.perf_counter()
        if not args.cold:
            model.decode_step(*model.example_inputs(cfg.max_batch))
            torch.cuda.synchronize(device)
        first_step_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cold = runner.capture()
        cold_wall_s = time.perf_counter() - t0
        cold_times = dict(runner.capture_times)
        runner.log_report(say)
        # The same ladder again, every shape's kernels and NCCL paths already set up.
        t0 = time.perf_counter()
        report = runner.recapture(reason="benchmark: warm capture")
        warm_wall_s = time.perf_counter() - t0
        say(
            f"first eager step {first_step_s:.2f} s; capture {cold_wall_s:.2f} s "
            f"({cold_times}); warm recapture {warm_wall_s:.2f} s ({runner.capture_times})"
        )

        # 1. correctness on every rank, >= 500 steps with transitions
        phases = [int(x) for x in args.phases.split(",")]
        schedule = batch_schedule(args.steps, phases, cfg.max_batch)
        gen = torch.Generator(device=device).manual_seed(1)
        first = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), device=device, generator=gen)
        model.reset_cache()
        seqs = Sequences(cfg.max_batch, cfg.max_context, device)
        tokens = first
        worst, agree, total, bitwise, exact_bad, transitions = 0.0, 0, 0, 0, 0, 0
        prev = None
        for b in schedule:
            transitions += int(prev is not None and b != prev)
            prev = b
            pos, slots = seqs.step_inputs(b)
            tok = (
                tokens[:b]
                if tokens.shape[0] >= b
                else torch.cat([tokens, first[tokens.shape[0] : b]])
            )
            g = runner(tok, pos, slots).clone()
            e = model.decode_step(tok, pos, slots)
            same = torch.equal(g, e)
            bitwise += int(same)
            exact_bad += int(b in ladder and not same)
            worst = max(worst, float((g.float() - e.float()).abs().max()))
            agree += int((g.argmax(-1) == e.argmax(-1)).sum())
            total += b
            tokens = g.argmax(-1)
        check = {
            "rank": rank,
            "steps": len(schedule),
            "transitions": transitions,
            "bitwise_equal_steps": bitwise,
            "captured_size_steps_not_bitwise": exact_bad,
            "max_abs_logit_diff": worst,
            "argmax_agreement": agree / total,
            "tokens_checked": total,
        }
        check["ok"] = check["argmax_agreement"] == 1.0 and exact_bad == 0

        # 2. timing at fixed batch sizes
        timing = []
        for b in [int(x) for x in args.batches.split(",")]:
            if b > cfg.max_batch:
                continue
            inp = model.example_inputs(b, generator=torch.Generator().manual_seed(b))
            e_ms = isolated_ms(lambda inp=inp: model.decode_step(*inp), args.reps, warmup=5)
            g_ms = isolated_ms(lambda inp=inp: runner(*inp), args.reps, warmup=5)
            timing.append({"batch": b, "eager_ms": e_ms, "graphguard_ms": g_ms})

        # 3. host cost of the per-step agreement (gloo all-reduce of two int64)
        for _ in range(20):
            runner.agree_batch(1)
        samples = []
        for _ in range(200):
            t = time.perf_counter()
            runner.agree_batch(1)
            samples.append((time.perf_counter() - t) * 1e6)
        agree_us = statistics.median(samples)

        mine = {"check": check, "timing": timing, "agree_us": agree_us}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=runner.control_group)
    if rank == 0:
        for r, m in enumerate(everyone):
            c = m["check"]
            print(
                f"rank {r}: {c['steps']} steps, {c['transitions']} transitions, "
                f"{c['bitwise_equal_steps']} bitwise equal, argmax agreement "
                f"{100 * c['argmax_agreement']:.2f}%, max |diff| {c['max_abs_logit_diff']:.3g}, "
                f"agree {m['agree_us']:.1f} us, {'OK' if c['ok'] else 'FAILED'}"
            )
        print(f"{'B':>5} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}   (rank 0)")
        for t in everyone[0]["timing"]:
            print(
                f"{t['batch']:>5} {t['eager_ms']:>9.3f} {t['graphguard_ms']:>9.3f} "
                f"{t['eager_ms'] / t['graphguard_ms']:>7.2f}x"
            )
        gpu = torch.cuda.get_device_name(device).replace(" ", "-")
        date = datetime.date.today().isoformat()
        result = {
            "tp": world,
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": nccl_env,
            "preset": args.preset,
            "dtype": "bfloat16",
            "max_batch": cfg.max_batch,
            "context": cfg.max_context,
            "build_s": build_s,
            "first_eager_step_s": first_step_s,
            "capture_cold": {**cold.to_dict(), "wall_s": cold_wall_s, **cold_times},
            "capture": {**report.to_dict(), "wall_s": warm_wall_s, **runner.capture_times},
            "ranks": everyone,
            "ok": all(m["check"]["ok"] for m in everyone),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"tp{world}_{gpu}_{date}.json"
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    ok = all(m["check"]["ok"] for m in everyone)
    runner.release()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
