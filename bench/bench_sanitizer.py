"""What the sanitizer costs, in one run on a GPU: capture time and replay host time with
``sanitize=True`` vs off, and the plain runner vs a bare ``CUDAGraph.replay()``.

Method (as ``bench_dispatch.py``): the reference Llama decode model (``--preset``, bf16)
on the ladder ``--sizes``.

* capture: ``--capture-rounds`` rounds, each building a fresh runner with the sanitizer
  off and one with it on (alternating, so cache/clock drift hits both), timing
  ``capture()`` with ``perf_counter``; medians. The first (cold) round is discarded.
* replay: per variant, blocks of ``--calls`` calls at a captured size timed on the host
  with ``perf_counter`` (each block ends in an untimed synchronize); the median per-call
  host time over ``--repeats`` blocks, after 20 warm-up calls. Variants: ``bare_replay``
  (``runner.graph(size).replay()``, the floor), ``runner_off``, ``runner_on``.
* ``off_is_fast_path``: the plain runner's class uses ``GraphRunner.__call__`` itself.

Writes JSON to ``--out`` and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard.runner import GraphRunner
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.timing import host_us


def build(model: LlamaDecodeModel, sizes: list[int], sanitize: bool) -> GraphRunner:
    return gg.GraphRunner(
        model.decode_step,
        model.example_inputs(min(4, model.config.max_batch)),
        sizes=sizes,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        sanitize=sanitize,
        progress=False,
        name=f"llama-{'on' if sanitize else 'off'}",
    )


def timed_capture(model: LlamaDecodeModel, sizes: list[int], sanitize: bool) -> float:
    runner = build(model, sizes, sanitize)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.capture()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    runner.release()
    return elapsed


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--capture-rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    sizes = sorted(int(s) for s in args.sizes.split(","))
    cfg = LlamaConfig.preset(args.preset, max_batch=max(sizes))
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16)
    res: dict[str, Any] = {}
    with torch.inference_mode():
        caps: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.capture_rounds + 1):
            for sanitize in (False, True) if round_ % 2 == 0 else (True, False):
                t = timed_capture(model, sizes, sanitize)
                if round_:  # round 0 is cold (kernel selection, lazy init): discarded
                    caps[sanitize].append(t)
            model.workspace.unlock(reason="benchmark: next round captures again")
        res["capture_off_s"] = statistics.median(caps[False])
        res["capture_on_s"] = statistics.median(caps[True])
        res["capture_ratio"] = res["capture_on_s"] / res["capture_off_s"]

        off = build(model, sizes, False)
        on = build(model, sizes, True)
        off.capture()
        model.workspace.unlock(reason="benchmark: second runner")
        on.capture()
        size = sizes[len(sizes) // 2]
        inputs = model.example_inputs(size)
        torch.testing.assert_close(
            off(*inputs).clone(), model.decode_step(*inputs), rtol=2e-2, atol=2e-2
        )
        torch.testing.assert_close(
            on(*inputs).clone(), model.decode_step(*inputs), rtol=2e-2, atol=2e-2
        )
        graph = off.graph(size)
        res["replay_size"] = size
        res["bare_replay_us"] = host_us(graph.replay, args.calls, args.repeats)
        res["runner_off_us"] = host_us(lambda: off(*inputs), args.calls, args.repeats)
        res["runner_on_us"] = host_us(lambda: on(*inputs), args.calls, args.repeats)
        res["watched_storages"] = len(on.watched_storages(size))  # type: ignore[attr-defined]
    res["off_minus_bare_us"] = res["runner_off_us"] - res["bare_replay_us"]
    res["on_minus_off_us"] = res["runner_on_us"] - res["runner_off_us"]
    res["off_is_fast_path"] = type(off).__call__ is GraphRunner.__call__
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "sizes": sizes,
        "capture_rounds": args.capture_rounds,
        "calls_per_block": args.calls,
        "repeats": args.repeats,
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()},
    }
    print(f"sanitizer cost on {out['gpu']} (torch {out['torch']}, {args.preset}, sizes {sizes})")
    print(f"  {'capture, sanitizer off':<34}{res['capture_off_s'] * 1e3:>10.1f} ms")
    print(
        f"  {'capture, sanitizer on':<34}{res['capture_on_s'] * 1e3:>10.1f} ms"
        f"   ({res['capture_ratio']:.2f}x, target <= 2x)"
    )
    print(f"  {'bare CUDAGraph.replay()':<34}{res['bare_replay_us']:>10.2f} us/call")
    print(
        f"  {'runner, sanitizer off':<34}{res['runner_off_us']:>10.2f} us/call"
        f"   (+{res['off_minus_bare_us']:.2f} us: the runner's dispatch)"
    )
    print(
        f"  {'runner, sanitizer on':<34}{res['runner_on_us']:>10.2f} us/call"
        f"   (+{res['on_minus_off_us']:.2f} us, {res['watched_storages']} storages checked)"
    )
    print(f"  off path is GraphRunner.__call__ itself: {res['off_is_fast_path']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
