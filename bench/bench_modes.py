"""Graph modes on the reference model's mixed step: NONE, PIECEWISE, FULL, FULL_AND_PIECEWISE.

One run, one GPU. ``LlamaDecodeModel.mixed_step`` (attention = the custom op
``graphguard_ref::mixed_attention``, the PIECEWISE split point) is served through a
:class:`~graphguard.dispatch.Dispatcher` per mode. Two runners are captured once and
shared by the modes: a GraphRunner over ``mixed_step`` (FULL graphs, uniform decode
sizes) and a PiecewiseRunner (one ``torch.compile``, pieces captured per size); so
PIECEWISE and FULL_AND_PIECEWISE pay one compile, and FULL_AND_PIECEWISE's capture cost
is the sum of both, exactly what ``Dispatcher.capture()`` would do.

Measured per mode:

* ms/step (CUDA events over back-to-back steps, median of blocks) for uniform decode
  batches (B requests of q = 1 + K tokens) and for mixed batches (D decoding requests
  plus one request prefilling a P-token chunk), with what ran (full / piecewise / eager,
  from the mode's plan) and the max |logit diff| to eager;
* capture time (compile included for piecewise) and graph pool bytes (the runners'
  capture reports, plus the reserved-memory growth around each capture).

Writes JSON to ``--out`` (a file, or a directory to get ``modes_<gpu>_<date>.json``).
Defaults: llama-1b shapes, bf16, random weights, context 1024; about 1-2 min on an H200.
``--preset tiny`` runs in seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import graphguard as gg
except ImportError:  # running from a checkout without PYTHONPATH=src:ref/src
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ref" / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import graphguard as gg

from graphguard.backend import RecordingBackend
from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan
from graphguard.piecewise import PiecewiseRunner
from graphguard_ref.llama import MIXED_ATTENTION_OP, LlamaConfig, LlamaDecodeModel
from graphguard_ref.timing import cuda_ms

MODES = ("none", "piecewise", "full", "full_and_piecewise")
GIB = float(1 << 30)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def parse_mixed(text: str) -> list[tuple[int, int]]:
    """``"4:12,32:32"`` -> [(decoding requests, prefill chunk tokens), ...]."""
    out = []
    for part in text.replace(" ", "").split(","):
        d, p = part.split(":")
        out.append((int(d), int(p)))
    return out


def make_inputs(
    decodes: int,
    q: int,
    chunk: int,
    cfg: LlamaConfig,
    device: torch.device,
    seed: int,
) -> tuple[BatchKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``decodes`` requests verifying ``q`` tokens each (slots 0..), plus one chunk."""
    g = torch.Generator().manual_seed(seed)
    context = cfg.max_context
    positions: list[int] = []
    slots: list[int] = []
    lo, hi = context // 2, context - q - 1
    for r in range(decodes):
        p = int(torch.randint(lo, hi, (1,), generator=g))
        positions += range(p, p + q)
        slots += [r] * q
    if chunk:
        start = context // 4
        positions += range(start, start + chunk)
        slots += [decodes] * chunk
    n = len(positions)
    if n == 0 or positions[-1] >= context:
        raise SystemExit(f"{decodes} decodes + a {chunk}-token chunk do not fit context {context}")
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    reqs = decodes + (1 if chunk else 0)
    key = BatchKey.decode(decodes, q) if not chunk else BatchKey.mixed(n, reqs)
    packed = torch.tensor([tokens, positions, slots], dtype=torch.long).to(device)
    return key, (packed[0], packed[1], packed[2])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--spec-tokens", type=int, default=0, help="K: uniform batches have q=1+K")
    ap.add_argument("--decode", default="1,8,32,64", help="uniform decode batches (requests)")
    ap.add_argument(
        "--mixed",
        default="4:12,28:36,64:64,64:192",
        help="mixed batches as decoding-requests:prefill-chunk-tokens",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument(
        "--num-layers", type=int, default=None, help="override the preset's layer count"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument(
        "--device",
        default="cuda",
        help="'cpu': a plumbing smoke test, graphs emulated by RecordingBackend, float32, "
        "host timings (meaningless as numbers)",
    )
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_modes needs a CUDA GPU (CUDA graphs); nothing to measure here")
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16 if cuda else torch.float32
    backend: Callable[[], Any] = (lambda: None) if cuda else RecordingBackend

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def reserved() -> int:
        return torch.cuda.memory_reserved() if cuda else 0

    q = 1 + args.spec_tokens
    decode_batches = parse_ints(args.decode)
    mixed_batches = parse_mixed(args.mixed)
    max_reqs = max([*decode_batches, *(d + 1 for d, _ in mixed_batches)])
    overrides: dict[str, Any] = {"max_batch": max_reqs + 1, "max_context": args.context}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    cfg = LlamaConfig.preset(args.preset, **overrides)
    t_start = time.perf_counter()
    model = LlamaDecodeModel.random(cfg, device=dev, dtype=dtype, seed=0)
    max_decode_tokens = max(decode_batches) * q
    max_tokens = max([max_decode_tokens, *(d * q + p for d, p in mixed_batches)])
    full_sizes = gg.capture_sizes(max_decode_tokens, multiple_of=q)
    pw_sizes = gg.capture_sizes(max_tokens)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    name = device_name.replace(" ", "-")
    print(
        f"{args.preset}: {cfg.num_params / 1e9:.2f} B params, {cfg.num_layers} layers, {dtype}, "
        f"context {cfg.max_context}, q={q}, "
        f"max_tokens {max_tokens}; FULL sizes {len(full_sizes)} up to {full_sizes[-1]}, "
        f"piecewise sizes {len(pw_sizes)} up to {pw_sizes[-1]} on {name}"
    )
    example = model.example_inputs(1)
    fill = model.pad_fill_values()
    names = ("token_ids", "positions", "slots")
    capture: dict[str, dict[str, Any]] = {"none": {"capture_s": 0.0, "pool_bytes": 0}}
    with torch.inference_mode():
        # FULL graphs (GraphRunner over mixed_step, uniform sizes).
        full = gg.GraphRunner(
            model.mixed_step,
            example,
            sizes=full_sizes,
            fill_values=fill,
            names=names,
            progress=False,
            backend=backend(),
            name="bench.full",
        )
        sync()
        r0 = reserved()
        t0 = time.perf_counter()
        report_full = full.capture()
        capture["full"] = {
            "capture_s": time.perf_counter() - t0,
            "pool_bytes": report_full.pool_bytes,
            "reserved_growth_bytes": reserved() - r0,
            "sizes": list(full_sizes),
            "report": report_full.to_dict(),
        }
        print(f"FULL: {report_full.summary()}")
        # PIECEWISE graphs (one compile, pieces per size).
        torch._dynamo.reset()
        pw = PiecewiseRunner(
            model.mixed_step,
            example,
            split_ops=[MIXED_ATTENTION_OP],
            sizes=pw_sizes,
            fill_values=fill,
            names=names,
            progress=False,
            backend=backend(),
            name="bench.piecewise",
        )
        sync()
        r0 = reserved()
        t0 = time.perf_counter()
        pw.compile()
        compile_s = time.perf_counter() - t0
        report_pw = pw.capture()
        capture["piecewise"] = {
            "capture_s": time.perf_counter() - t0,
            "compile_s": compile_s,
            "pool_bytes": report_pw.pool_bytes,
            "reserved_growth_bytes": reserved() - r0,
            "sizes": list(pw_sizes),
            "pieces": len(pw.pieces),
            "compile_count": pw.compile_count,
            "report": report_pw.to_dict(),
        }
        print(f"PIECEWISE: compile {compile_s:.1f} s, {report_pw.summary()}; {pw.describe()}")
        capture["full_and_piecewise"] = {
            key: capture["full"][key] + capture["piecewise"][key]
            for key in ("capture_s", "pool_bytes", "reserved_growth_bytes")
        }
        capture["full_and_piecewise"]["note"] = "sum of the FULL and PIECEWISE captures"

        dispatchers: dict[str, Dispatcher] = {}
        for mode in MODES:
            plan = DispatchPlan(
                mode,
                max_tokens=max_tokens,
                query_len=q,
                full_sizes=full_sizes if mode in ("full", "full_and_piecewise") else None,
                piecewise_sizes=pw_sizes if mode in ("piecewise", "full_and_piecewise") else None,
                name=f"bench.{mode}",
            )
            print(plan.table())
            dispatchers[mode] = Dispatcher(
                plan,
                eager=model.mixed_step,
                full=full if plan.mode.has_full else None,
                piecewise=pw if plan.mode.has_piecewise else None,
            )

        batches: list[tuple[str, int, int, BatchKey, Any]] = []
        for b in decode_batches:
            key, inputs = make_inputs(b, q, 0, cfg, dev, seed=b)
            batches.append(("decode", b, 0, key, inputs))
        for d, p in mixed_batches:
            key, inputs = make_inputs(d, q, p, cfg, dev, seed=1000 + d + p)
            batches.append(("mixed", d, p, key, inputs))

        rows: list[dict[str, Any]] = []
        for label, reqs, chunk, key, inputs in batches:
            eager_out = model.mixed_step(*inputs).float()
            scale = float(eager_out.abs().max())
            row: dict[str, Any] = {
                "batch": label,
                "requests": reqs + (1 if chunk else 0),
                "decode_requests": reqs,
                "prefill_chunk": chunk,
                "tokens": key.num_tokens,
                "key": str(key),
            }
            for mode, disp in dispatchers.items():
                decision = disp.plan.resolve(key)
                out = disp(key, *inputs).float()
                diff = float((out - eager_out).abs().max())

                def step(disp: Dispatcher = disp, key: BatchKey = key, inputs: Any = inputs) -> Any:
                    return disp(key, *inputs)

                ms = cuda_ms(step, args.reps, blocks=args.blocks, warmup=3, cuda=cuda)
                row[mode] = {
                    "ms": ms,
                    "ran": decision.kind,
                    "padded_to": decision.size,
                    "max_abs_diff": diff,
                    "rel_diff": diff / max(scale, 1e-6),
                }
            rows.append(row)
            print(
                f"{label:>6} {key.num_tokens:>4} tok: "
                + "  ".join(f"{m} {row[m]['ms']:.3f} ms ({row[m]['ran']})" for m in MODES),
                flush=True,
            )

    result: dict[str, Any] = {
        "bench": "modes",
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "date": datetime.date.today().isoformat(),
        "preset": args.preset,
        "num_layers": cfg.num_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "context": cfg.max_context,
        "spec_tokens": args.spec_tokens,
        "query_len": q,
        "max_tokens": max_tokens,
        "timing": f"{'CUDA events' if cuda else 'host wall time'}, {args.reps} back-to-back "
        f"steps, median of {args.blocks}",
        "capture": capture,
        "plans": {m: d.plan.to_dict() for m, d in dispatchers.items()},
        "rows": rows,
        "total_s": time.perf_counter() - t_start,
    }
    hdr = f"{'batch':>6} {'tokens':>6} " + " ".join(f"{m:>20}" for m in MODES)
    print()
    print("ms/step (what ran)")
    print(hdr)
    for row in rows:
        print(
            f"{row['batch']:>6} {row['tokens']:>6} "
            + " ".join(f"{row[m]['ms']:>10.3f} {row[m]['ran']:>9}" for m in MODES)
        )
    print(f"{'mode':>20} {'capture s':>10} {'pool GiB':>9}")
    for m in MODES:
        c = capture[m]
        print(f"{m:>20} {c['capture_s']:>10.2f} {c['pool_bytes'] / GIB:>9.3f}")
    worst = max(r[m]["rel_diff"] for r in rows for m in MODES)
    print(f"worst rel |logit diff| vs eager: {worst:.2e}")
    out = args.out
    if out.suffix != ".json":
        out = out / f"modes_{name}_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['total_s']:.0f} s total)")
    full.release()
    pw.release()
    return result


if __name__ == "__main__":
    main()
