"""Host-side cost of one runner call vs a bare ``CUDAGraph.replay()`` of the same graph.

Method: a tiny 3-input graph (token/position/slot lookups, a few microseconds of GPU
work) so the GPU never backs up the launch queue; time blocks of ``--calls`` calls on the
host with ``perf_counter`` (each block ends in a synchronize that is not timed), and
report the median per-call host time over ``--repeats`` blocks. Variants, same graph:

* ``bare_replay``: ``graph.replay()`` alone (the floor);
* ``runner_exact``: ``runner(tokens, positions, slots)`` at a captured size;
* ``runner_padded``: a batch that pads to the next captured size;
* ``runner_shrinking``: alternating 64 / 37 (padded rows refilled on every shrink);
* ``runner_zero_copy_replay``: ``runner.replay(n)`` after writing the batch straight into
  ``runner.static_inputs(n)`` (the persistent-buffer path engines use);
* ``naive``: what a hand-rolled dispatcher does (copy each input into a static slice,
  fill the padded tail of each, replay);
* ``eager_launch``: one small eager kernel launch, for scale.

Results are checked against eager before timing. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import graphguard as gg
from graphguard_ref.timing import host_us


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    emb = torch.randn(1000, 64, device=dev, generator=g)
    pos = torch.randn(1024, 64, device=dev, generator=g)
    slot = torch.randn(257, 64, device=dev, generator=g)

    def step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return emb[tokens] + pos[positions] * slot[slots]

    def batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator(device=dev).manual_seed(seed)
        return (
            torch.randint(0, 1000, (n,), device=dev, generator=gen),
            torch.randint(0, 1024, (n,), device=dev, generator=gen),
            torch.randint(0, 256, (n,), device=dev, generator=gen),
        )

    runner = gg.GraphRunner(
        step,
        batch(4, 0),
        sizes=gg.capture_sizes(256),
        fill_values=(0, 0, 256),
        progress=False,
        name="dispatch",
    )
    with torch.inference_mode():
        runner.capture()
        exact, padded, shrink = batch(64, 1), batch(37, 2), batch(37, 3)
        for b in (exact, padded, shrink):
            torch.testing.assert_close(runner(*b), step(*b))
        graph = runner.graph(64)
        static = runner.static.buffers
        fills = (0, 0, 256)

        def naive() -> None:
            n, p = 37, 40
            for buf, x, f in zip(static, padded, fills):
                buf[:n].copy_(x)
                buf[n:p].fill_(f)
            runner.graph(p).replay()

        flip = [exact, shrink]
        state = {"i": 0}

        def shrinking() -> None:
            state["i"] ^= 1
            runner(*flip[state["i"]])

        for v, x in zip(runner.static_inputs(64), exact):
            v.copy_(x)
        small = torch.randn(64, device=dev)
        res = {
            "bare_replay_us": host_us(graph.replay, args.calls, args.repeats),
            "runner_exact_us": host_us(lambda: runner(*exact), args.calls, args.repeats),
            "runner_padded_us": host_us(lambda: runner(*padded), args.calls, args.repeats),
            "runner_shrinking_us": host_us(shrinking, args.calls, args.repeats),
            "runner_zero_copy_replay_us": host_us(
                lambda: runner.replay(64), args.calls, args.repeats
            ),
            "naive_us": host_us(naive, args.calls, args.repeats),
            "eager_launch_us": host_us(lambda: small.add_(0.0), args.calls, args.repeats),
        }
    res["dispatch_overhead_us"] = res["runner_exact_us"] - res["bare_replay_us"]
    res["dispatch_overhead_padded_us"] = res["runner_padded_us"] - res["bare_replay_us"]
    res["zero_copy_overhead_us"] = res["runner_zero_copy_replay_us"] - res["bare_replay_us"]
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "calls_per_block": args.calls,
        "repeats": args.repeats,
        **{k: round(v, 3) for k, v in res.items()},
    }
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
