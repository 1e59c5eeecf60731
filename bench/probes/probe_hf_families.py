"""Families graphguard's tests do not build: tiny seeded configs of many transformers
architectures, each generated greedily by HF (``model.generate``) and by
``GraphedCausalLM`` with HF's eager kernels and with ``compile=True``, compared token for
token (float32). Refused models are listed with the reason. What this shows: the
integration (and the decoder-block compile) holds on code nobody here wrote.

Run: ``python bench/probes/probe_hf_families.py --out FILE [--device cuda]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ref" / "src"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests import hf_families as F  # noqa: E402

import graphguard as gg  # noqa: E402
from graphguard.errors import UnsupportedModelError  # noqa: E402
from graphguard.integrations.transformers import TRANSFORMERS_VERSION, GraphedCausalLM  # noqa: E402

FAMILIES = F.OTHER_FAMILIES


def build(name: str, device: str) -> Any:
    return F.other_model(name, device)


def probe(name: str, device: str, new: int) -> dict[str, Any]:
    row: dict[str, Any] = {"family": name}
    model = build(name, device)
    ok, why = GraphedCausalLM.supported(model, max_cache_len=64)
    if not ok:
        row["refused"] = why
        return row
    ids, mask = (t.to(device) for t in F.prompts(3, seed=1))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    backend = gg.RecordingBackend() if device == "cpu" else None
    row["attention"] = model.config._attn_implementation
    for compile in (False, True):
        key = "compile" if compile else "eager_kernels"
        torch._dynamo.reset()
        g = GraphedCausalLM(
            model, max_batch=4, max_cache_len=64, backend=backend, progress=False, compile=compile
        )
        t0 = time.perf_counter()
        try:
            report = g.capture()
        except UnsupportedModelError as exc:  # refused at capture, with the reason
            row[f"{key}_refused"] = str(exc.reasons[0] if exc.reasons else exc)
            continue
        row[f"{key}_capture_s"] = round(time.perf_counter() - t0, 2)
        got = g.generate(ids, mask, max_new_tokens=new)
        row[f"{key}_equal"] = bool(torch.equal(got, want))
        if compile:
            row["compile_scope"] = g.compile_scope
            row["compiles"] = report.compiles
        g.release()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--new", type=int, default=16, help="greedy tokens per prompt")
    args = ap.parse_args()
    rows = []
    for name in args.families.split(","):
        try:
            row = probe(name, args.device, args.new)
        except Exception as exc:  # recorded: the probe reports, it does not stop
            row = {"family": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    graphed = [r for r in rows if "compiles" in r]
    eager_ok = [r for r in rows if "eager_kernels_equal" in r]
    result = {
        "probe": "hf_families",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
        "dtype": "float32",
        "prompts": "3 left-padded prompts, greedy",
        "new_tokens": args.new,
        "graphed_eager_kernels": len(eager_ok),
        "graphed_compiled": len(graphed),
        "all_equal": all(r["eager_kernels_equal"] for r in eager_ok)
        and all(r["compile_equal"] for r in graphed),
        "refused_at_capture": [r["family"] for r in rows if "eager_kernels_refused" in r],
        "one_compile": all(r["compiles"] == 1 for r in graphed),
        "refused": [r["family"] for r in rows if "refused" in r],
        "errors": [r["family"] for r in rows if "error" in r],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
