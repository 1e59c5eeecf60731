"""Probe: where the RL loop's one "stale" finding came from (rl-loop H200 run, 0535d75).

The run's first full proof (step 9) listed one stale read, "unnamed 8716288 B allocation
at 0x7fde3f800000 (elementwise add kernel)", and the next proofs none. Graphs are read
on the first question, so an unnamed word's allocation is judged as it is then. This
probe runs the same loop (0.5B Llama shape, bf16) with a full proof after every step and
the allocator's history on, and for every unnamed word any graph holds prints: the graph,
the kernel, whether the word is proven taken (an exact pointer argument) or a word inside
a struct argument, and the allocator's events for that address (who allocated the block
and when, against the step the graph was captured in). Writes ``$OUT/rl-stale.json``.

``PYTHONPATH=src:ref/src python3 bench/probes/probe_rl_stale.py --out $OUT --steps 14``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_example() -> Any:
    name = "grpo_continuous_batching"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def frames(ev: dict[str, Any], n: int = 14) -> list[str]:
    out = []
    for f in ev.get("frames", []):
        fn = str(f.get("filename", ""))
        if "torch/" in fn and "graphguard" not in fn:
            continue
        out.append(f"{fn.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}")
        if len(out) >= n:
            break
    return out


def events_for(addr: int, traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    got = []
    for ev in traces:
        a, s = int(ev.get("addr", 0)), int(ev.get("size", 0))
        if a <= addr < a + max(s, 1):
            got.append(
                {
                    "action": ev.get("action"),
                    "addr": hex(a),
                    "size": s,
                    "time_us": ev.get("time_us"),
                    "stream": ev.get("stream"),
                    "frames": frames(ev),
                }
            )
    return got[-12:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=14)
    args = ap.parse_args()
    ex = load_example()
    cfg = dataclasses.replace(
        ex.LoopConfig(seed=0),
        preset="0.5b",
        dtype="bfloat16",
        steps=args.steps,
        prompts=64,
        samples=8,
        prompt_len=(8, 32),
        new_tokens=(8, 24),
        lr=5e-4,
        train_seqs=64,
        canary_every=100,
        proof_every=1,
        max_batch_tokens=1024,
        num_blocks=512,
        max_graphs=256,
    )
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=400_000
    )
    marks: list[dict[str, Any]] = []
    findings: list[dict[str, Any]] = []
    engine_box: dict[str, Any] = {}
    t_start = time.time()

    def on_step(row: dict[str, Any]) -> None:
        marks.append({"step": row["step"], "time_us": int(time.time() * 1e6)})
        engine = engine_box.get("engine")
        if engine is None:
            return
        audits = engine.audit()
        snap = torch.cuda.memory._snapshot()
        traces = [ev for dev in snap.get("device_traces", []) for ev in dev]
        for a in audits:
            for g in a.graphs:
                for w in (*g.unknown, *g.unowned):
                    findings.append(
                        {
                            "step": row["step"],
                            "graph": g.where,
                            "word": hex(w.address),
                            "kernel": w.kernel[:160],
                            "nbytes": w.nbytes,
                            "freed_flag": w.freed,
                            "proven": getattr(w, "proven", None),
                            "unowned": w in g.unowned,
                            "events": events_for(w.address, traces),
                        }
                    )
            for name, what, keys in a.stale:
                findings.append({"step": row["step"], "stale": name, "what": what, "keys": keys})
        words = sum(len(g.unknown) for a in audits for g in a.graphs)
        v = row["verdict"]
        print(f"step {row['step']}: ok={v.get('ok')} stale={v.get('stale')} words={words}")

    orig_build = ex.build_engine

    def build(model: Any, c: Any, backend: Any = None) -> Any:
        e = orig_build(model, c, backend)
        engine_box["engine"] = e
        return e

    ex.build_engine = build
    out = ex.run_loop(cfg, on_step=on_step, log=lambda s: print(s, flush=True))
    out["engine"].close()
    torch.cuda.memory._record_memory_history(enabled=None)
    # One entry per (graph, word): the last step's view, and every stale finding.
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    stale = [f for f in findings if "stale" in f]
    for f in findings:
        if "word" in f:
            seen[(f["graph"], f["word"])] = f
    result = {
        "t_start": t_start,
        "marks": marks,
        "stale": stale,
        "words": list(seen.values()),
        "rows": [
            {k: v for k, v in r.items() if k in ("step", "verdict", "stale_reads")}
            for r in out["rows"]
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rl-stale.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"stale findings: {len(stale)}; distinct unnamed words: {len(seen)}")
    for f in stale:
        print("STALE", json.dumps(f, default=str)[:600])
    for f in list(seen.values())[:12]:
        print("WORD", json.dumps({k: f[k] for k in f if k != "events"}, default=str))
        for ev in f["events"][-4:]:
            print("   ", ev["action"], ev["addr"], ev["size"], ev["time_us"], ev["frames"][:6])


if __name__ == "__main__":
    main()
