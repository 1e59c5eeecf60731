"""Where ``GraphedCausalLM``'s build goes on the GPU (issue 41: time to the first token).

The bench's HF Llama-1B shape (``bench_hf.build``), bf16; ``GraphedCausalLM(max_batch=64,
max_cache_len=256, lazy=True)`` built three times (the first in the process, then warm),
each synchronized and timed, the first under ``cProfile`` (top functions by cumulative
time, to stdout and ``--out``). ``GRAPHGUARD_COMMIT=<sha> PYTHONPATH=src python3
bench/probes/probe_hf_build.py --out probe-hf-build.json``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from bench_hf import build  # noqa: E402
from graphguard.integrations.transformers import GraphedCausalLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = build(256)
    ids = torch.randint(3, model.config.vocab_size, (8, 32), device="cuda")
    with torch.inference_mode():
        model(ids, attention_mask=torch.ones_like(ids))  # the process's first forward
    torch.cuda.synchronize()
    builds = []
    text = ""
    for i in range(3):
        prof = cProfile.Profile() if i == 0 else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        g = GraphedCausalLM(model, max_batch=64, max_cache_len=256, progress=False, lazy=True)
        torch.cuda.synchronize()
        if prof is not None:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(40)
            text = buf.getvalue()
        builds.append(time.perf_counter() - t)
        del g
        torch.cuda.synchronize()
    result = {
        "probe": "hf-build",
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name(),
        "build_s": builds,
        "note": "the first build ran under cProfile",
        "profile_top": text.splitlines()[:70],
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(builds))
    print(text[:6000])


if __name__ == "__main__":
    main()
