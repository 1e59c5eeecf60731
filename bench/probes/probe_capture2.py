"""Second capture probe: which part of a graphguard ladder is slower than a hand-rolled one.

Reference model, llama-1b shapes, bf16, kernels warm. Times (host wall, synchronized):
one eager forward at B=64 in several contexts (default stream, side stream, phase
WARMUP, the runner's static views, sync-debug "error" mode); hand-rolled and graphguard
ladders interleaved (to expose order effects); graphguard with the allocator cache
emptied or not before it. Prints JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the probe it extends

from probe_capture import ladder_runner

import graphguard as gg
from bench_decode import handrolled_ladder
from graphguard import phase
from graphguard._unwind import sync_debug_error
from graphguard.phase import Phase
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def wall_ms(fn: Any, reps: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig.preset("llama-1b", max_batch=256, max_context=1024)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    ladder = gg.capture_sizes(cfg.max_batch)
    res: dict[str, Any] = {}
    with torch.inference_mode():
        model.warm_kernels(ladder)
        for s in ladder:
            model.decode_step(*model.example_inputs(s))
        runner = ladder_runner(model, ladder)
        inp = model.example_inputs(64)
        side = torch.cuda.Stream()
        views = runner.static.views(64)

        def on_side(fn: Any) -> Any:
            def run() -> Any:
                with torch.cuda.stream(side):
                    return fn()

            return run

        def in_phase(p: Phase, fn: Any) -> Any:
            def run() -> Any:
                with phase.capture_window("probe"), phase.enter(p, owner="probe"):
                    return fn()

            return run

        def debug(fn: Any) -> Any:
            def run() -> Any:
                with sync_debug_error():
                    return fn()

            return run

        def step() -> Any:
            return model.decode_step(*inp)

        def step_views() -> Any:
            return model.decode_step(*views)

        res["forward_ms"] = {
            "default_stream": wall_ms(step),
            "side_stream": wall_ms(on_side(step)),
            "warmup_phase": wall_ms(in_phase(Phase.WARMUP, step)),
            "warmup_phase_side": wall_ms(on_side(in_phase(Phase.WARMUP, step))),
            "static_views": wall_ms(step_views),
            "sync_debug_error": wall_ms(debug(step)),
            "runner_forward_warmup": wall_ms(
                on_side(in_phase(Phase.WARMUP, lambda: runner._forward(*views)))
            ),
        }
        print(res, flush=True)

        def hand() -> float:
            s, _, graphs = handrolled_ladder(
                model.decode_step, model.example_inputs, ladder, torch.device("cuda")
            )
            del graphs
            return s

        def guard(empty: bool) -> float:
            runner.release()
            model.workspace.unlock(reason="probe")
            if not empty:
                # release() empties the cache; fill it again with blocks of the sizes the
                # warmups use, as the hand-rolled loop finds them.
                for s in ladder[::-1][:2]:
                    model.decode_step(*model.example_inputs(s))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = runner.capture()
            wall = time.perf_counter() - t0
            res.setdefault("guard_reports", []).append(
                {
                    "wall_s": wall,
                    "total_s": rep.total_s,
                    "warmup_s": sum(x.warmup_s for x in rep.sizes),
                    "capture_s": sum(x.capture_s for x in rep.sizes),
                    "empty": empty,
                }
            )
            return wall

        runner.capture()
        order = []
        for _ in range(3):
            order.append(("hand", hand()))
            order.append(("guard", guard(empty=True)))
            order.append(("guard_nocacheempty", guard(empty=False)))
            order.append(("hand", hand()))
        res["order"] = order
        for name in ("hand", "guard", "guard_nocacheempty"):
            res[name + "_median_s"] = statistics.median(v for k, v in order if k == name)
        res["ratio"] = res["guard_median_s"] / res["hand_median_s"]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
