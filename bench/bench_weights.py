"""Weight updates under live graphs (issue 22): ``update_weights`` vs a full ``recapture()``.

On the reference Llama-3.2-1B decode step (bf16, the default ladder ``capture_sizes(64)``,
arena and kernel warmups as in ``bench_decode.py``), medians of:

* ``update_ms``: ``runner.update_weights(sd)`` from a device state dict (a trainer on the
  same GPU), CUDA events around the whole call (validation, one fused copy per device
  pair, the device synchronize, ``check_weights``);
* ``copy_ms``: one bare ``torch._foreach_copy_`` of the same tensors: the floor;
* ``update_h2d_ms``: the same update from a pinned host state dict;
* ``check_us``: ``check_weights()`` alone (host microseconds: no device work);
* ``recapture_s``: a full ``recapture(reason=...)`` of the ladder (warm process);
* ``recapture_moved_s``: ``recapture(only_moved=True)`` after one rebound weight
  (sanitizer off: every size).

Targets (issue 22): update no more than about one device copy plus a few ms, and at
least 10x faster than recapture. After the updates, the size-8 graph is compared with
eager on the padded batch (bitwise). Writes ``<out>/weights_<gpu>_<date>.json``.
``--device cpu --preset tiny`` is a smoke run of the plumbing (RecordingBackend, host
times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.timing import isolated_ms


def _host_ms(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    if cuda:
        return isolated_ms(fn, reps, warmup=2)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _seconds(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--recapture-reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu --preset tiny for a smoke run")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = LlamaConfig.preset(args.preset, max_batch=args.max_batch, max_context=args.context)
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=0)
    ladder = gg.capture_sizes(cfg.max_batch)
    with torch.inference_mode():
        model.warm_kernels(ladder)
    runner = gg.GraphRunner(
        model.decode_step,
        model.example_inputs(1),
        sizes=ladder,
        fill_values=model.pad_fill_values(),
        before_capture=[model.warm_kernels],
        workspaces=[model.workspace],
        state=[],
        progress=False,
        name="bench_weights",
        backend=None if cuda else gg.RecordingBackend(),
    )
    with torch.inference_mode():
        cold = runner.capture()
    params = dict(model.named_parameters())  # tied lm_head once
    gen = torch.Generator(device=dev).manual_seed(1)
    sd = {k: torch.empty_like(v).normal_(0, 0.02, generator=gen) for k, v in params.items()}
    nbytes = sum(v.nbytes for v in sd.values())
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "params": cfg.num_params,
        "weight_bytes": nbytes,
        "tensors_updated": len(sd),
        "sizes": len(ladder),
        "capture_cold_s": cold.total_s,
    }
    dsts, srcs = list(params.values()), list(sd.values())

    def bare_copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)

    result["copy_ms"] = _host_ms(bare_copy, args.reps, cuda)
    result["update_ms"] = _host_ms(lambda: runner.update_weights(sd), args.reps, cuda)
    last = runner.update_weights(sd)
    result["update_report_s"] = last.seconds
    pinned = {k: v.cpu().pin_memory() if cuda else v.clone() for k, v in sd.items()}
    result["update_h2d_ms"] = _host_ms(lambda: runner.update_weights(pinned), 5, cuda)
    found = runner.check_weights()
    result["check_tensors"] = found.checked
    t0 = time.perf_counter()
    for _ in range(200):
        runner.check_weights()
    result["check_us"] = (time.perf_counter() - t0) / 200 * 1e6

    # Correctness after the updates: the size-8 graph vs eager on the padded batch.
    with torch.inference_mode():
        x = model.example_inputs(5, generator=torch.Generator().manual_seed(0))
        p = runner.padded_size(5) or 5
        padded = [
            torch.cat([t, torch.full((p - 5,), f, dtype=t.dtype, device=t.device)])
            for t, f in zip(x, model.pad_fill_values())
        ]
        model.reset_cache()
        want = model.decode_step(*padded)[:5].clone()
        model.reset_cache()
        got = runner(*x).clone()
    result["bitwise_equal_eager_after_update"] = bool(torch.equal(got, want))

    with torch.inference_mode():
        result["recapture_s"] = _seconds(
            lambda: runner.recapture(reason="bench: full recapture"), args.recapture_reps
        )
        w = model.layers[0].o_weight
        model.layers[0].o_weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        t0 = time.perf_counter()
        runner.recapture(reason="bench: one weight rebound", only_moved=True)
        result["recapture_moved_s"] = time.perf_counter() - t0
    copy_ms, update_ms = result["copy_ms"], result["update_ms"]
    result["update_over_copy_ms"] = update_ms - copy_ms
    result["recapture_over_update"] = result["recapture_s"] * 1e3 / update_ms
    result["copy_GBps"] = nbytes / (copy_ms / 1e3) / 1e9
    result["targets"] = {
        "update_within_copy_plus_5ms": update_ms <= copy_ms + 5.0,
        "at_least_10x_faster_than_recapture": result["recapture_over_update"] >= 10.0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = result["gpu"].replace(" ", "-")
    path = args.out / f"weights_{gpu}_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(
        f"update_weights {update_ms:.2f} ms (bare copy {copy_ms:.2f} ms of "
        f"{nbytes / 2**30:.2f} GiB), check_weights {result['check_us']:.0f} us for "
        f"{found.checked} tensors, full recapture {result['recapture_s']:.2f} s "
        f"({result['recapture_over_update']:.0f}x the update) -> {path}"
    )
    runner.release()


if __name__ == "__main__":
    main()
