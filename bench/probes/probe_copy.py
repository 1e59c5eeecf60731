"""Probe: which in-place copy of a model's weights is fastest on this GPU (issue 40:
``update_weights`` against a bare copy).

The reference Llama-1B step's parameters (bf16, 2.3 GiB, tied names once) from a
device copy of themselves, three ways, alternated, each timed as synchronized wall time
and as CUDA-event device time (medians):

* ``foreach``: one ``torch._foreach_copy_`` (what ``update_weights`` launches, and the
  bench's bare copy);
* ``each``: ``dst.copy_(src)`` per tensor (contiguous, same dtype: a device-to-device
  ``cudaMemcpyAsync`` each);
* ``foreach_big_each_small``: ``copy_`` for tensors of at least 1 MiB, one
  ``_foreach_copy_`` for the rest.

Every form's result is checked equal to the source. Writes ``--out`` (JSON).
``GRAPHGUARD_COMMIT=<sha> PYTHONPATH=src:ref/src python3 bench/probes/probe_copy.py --out
probe-copy.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    cfg = LlamaConfig.preset("llama-1b", max_batch=64, max_context=512)
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    dsts = [p for _, p in model.named_parameters()]
    g = torch.Generator(device="cuda").manual_seed(1)
    srcs = [
        (p.detach().clone() + 1e-3 * torch.randn(p.shape, device="cuda", generator=g)).to(p.dtype)
        for p in dsts
    ]
    big = [i for i, d in enumerate(dsts) if d.nbytes >= 1 << 20]
    small = [i for i in range(len(dsts)) if i not in set(big)]

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs)

    def each() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def mixed() -> None:
        for i in big:
            dsts[i].copy_(srcs[i])
        if small:
            torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small])

    forms: dict[str, Any] = {"foreach": foreach, "each": each, "foreach_big_each_small": mixed}
    wall: dict[str, list[float]] = {k: [] for k in forms}
    dev: dict[str, list[float]] = {k: [] for k in forms}
    with torch.no_grad():
        for fn in forms.values():
            fn()
        for i in range(args.reps):
            for name in list(forms) if i % 2 == 0 else list(forms)[::-1]:
                for d in dsts:
                    d.zero_()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                a.record()  # type: ignore[no-untyped-call]
                forms[name]()
                b.record()  # type: ignore[no-untyped-call]
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t) * 1e3)
                dev[name].append(float(a.elapsed_time(b)))  # type: ignore[no-untyped-call]
                assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), name
    nbytes = sum(d.nbytes for d in dsts)
    result = {
        "probe": "copy",
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tensors": len(dsts),
        "big_tensors": len(big),
        "bytes": nbytes,
        "reps": args.reps,
        "wall_ms_median": {k: statistics.median(v) for k, v in wall.items()},
        "device_ms_median": {k: statistics.median(v) for k, v in dev.items()},
        "copy_gb_per_s_device": {
            k: nbytes / (statistics.median(v) * 1e-3) / 1e9 for k, v in dev.items()
        },
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
