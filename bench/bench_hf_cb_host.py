"""Host time per continuous-batching step spent in graphguard's wrapper (issue 32).

What runs in Python for one HF continuous-batching step under ``GraphedContinuousBatching``
(``StepGraphs.compute_batch``): the model check, HF's ``supports_logits_to_keep`` and
``_get_forward_fn``, the step's full key, the slot lookup and the runner's replay. A tiny
Llama (tests/hf_families.py) runs ``generate_batch`` once so every step key has its graph;
then each recorded key's step is called again, timed on the host (no synchronize), with
HF's forward replaced by a no-op for the steps that would run it eagerly. Reported per
step, best of 5 rounds: ``compute_batch`` for one key and for keys alternating (as a real
batch mix does), the key alone (``_signature``) and the replay alone, beside HF's own key
(``_get_graph_key``, what HF's graphs cost in Python). Also the device ops the wrapper
dispatches over 5 alternating steps (a CUDA kernel each outside a graph; on the CPU the
RecordingBackend's replay of the body counts too).

Run: ``PYTHONPATH=src:ref/src python bench/bench_hf_cb_host.py`` (CPU: ``RecordingBackend``;
``--device cuda`` for real graphs, where the replay is ``cudaGraphLaunch``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import hf_families as F
from tests.hf_cb import cb_config

import graphguard as gg
from graphguard.integrations.hf_continuous import GraphedContinuousBatching


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def best_us(fn: Callable[[], Any], n: int, sync: Callable[[], None]) -> float:
    out = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = cb_config(
        page=16,
        max_batch_tokens=64,
        num_blocks=64,
        q_padding_interval_size=16,
        kv_padding_interval_size=64,
    )
    model = F.model("llama", seed=0, device=args.device)
    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(12, 21)), [21] * 13, [33, 34]]
    backend = None if cuda else gg.RecordingBackend()
    cb = GraphedContinuousBatching(model, backend=backend, progress=False)
    cb.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
    steps = cb.steps
    assert steps is not None
    noop = lambda *a, **k: None  # noqa: E731
    for k, d in enumerate(steps._data):
        if d is not None:
            steps._data[k] = (noop, d[1])  # an emulated replay runs the body: no forward
    steps.model_runner._get_forward_fn = lambda use_block_table: (noop, None)
    slots = sorted(steps.slots.values())
    mix = [slots[0], slots[-1], slots[0], slots[len(slots) // 2], slots[-1]]
    n = args.steps
    rows = {}
    bd = steps._data[slots[0]][1]  # type: ignore[index]
    rows["compute_batch, one key"] = best_us(lambda: steps.compute_batch(model, bd), n, sync)

    def alternating() -> None:
        for s in mix:
            steps.compute_batch(model, steps._data[s][1])  # type: ignore[index]

    rows["compute_batch, keys alternating"] = best_us(alternating, n // 5, sync) / len(mix)
    if hasattr(steps, "_signature"):
        rows["  the key (_signature)"] = best_us(lambda: steps._signature(bd), n, sync)
    rows["  runner.replay(slot)"] = best_us(lambda: steps.runner.replay(slots[0]), n, sync)
    rows["  HF's own key (_get_graph_key)"] = best_us(steps.io._get_graph_key, n, sync)
    print(f"transformers {__import__('transformers').__version__}, {args.device}, "
          f"{len(slots)} keys")  # fmt: skip
    for label, us in rows.items():
        print(f"{label:36s} {us:7.2f} us/step")
    with CountOps() as c:
        alternating()
    print(f"device ops dispatched over {len(mix)} alternating steps: {len(c.ops)}")
    cb.close()


if __name__ == "__main__":
    main()
