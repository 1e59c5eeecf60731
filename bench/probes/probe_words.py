"""Which argument words of which kernels point where: the data behind "every word decided".

For each captured graph of a few runners (the reference 1B ladder, tiny HF families, a
module that memoizes a per-size mask), every kernel node's argument block is read again
and each word that is not a whole top-level pointer is placed: a named owner, this graph's
pool, another pool, a live or freed block of the general pool, or nowhere (noise). Per
kernel (demangled) and per (parameter, offset in it), the counts; and what ``audit()``
says. On the GPU machine: ``PYTHONPATH=src:ref/src python3 bench/probes/probe_words.py
--out $OUT``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard import _graph_args as ga
from graphguard.owners import hit_spans, spans_of


def kernel_nodes(raw: int) -> list[tuple[str, list[tuple[int, int]], bytes, bytes]]:
    d = ga.driver()
    t = d.CUgraphNodeType
    out = []
    stack = [d.CUgraph(raw)]
    while stack:
        g = stack.pop()
        _, n = ga._ok(d, "count", d.cuGraphGetNodes(g, 0))
        nodes, n = ga._ok(d, "nodes", d.cuGraphGetNodes(g, n))
        for node in list(nodes)[: int(n)]:
            kind = d.cuGraphNodeGetType(node)[1]
            if kind == t.CU_GRAPH_NODE_TYPE_KERNEL:
                p = ga._ok(d, "params", d.cuGraphKernelNodeGetParams(node))
                func = p.func
                if int(func) == 0 and int(p.kern) != 0:
                    func = ga._ok(d, "fn", d.cuKernelGetFunction(p.kern))
                lay = ga._layout(d, func)
                _, blob, exact = ga._kernel_bytes(d, p)
                out.append((lay.name, lay.params, blob, exact))
            elif kind == t.CU_GRAPH_NODE_TYPE_GRAPH:
                stack.append(ga._ok(d, "child", d.cuGraphChildGraphNodeGetGraph(node)))
    return out


def place(runner: Any, graphs: dict[int, Any], audit: Any, tag: str) -> dict[str, Any]:
    from graphguard._demangle import demangle  # the new module, if present

    amap = ga.AllocatorMap(torch.device("cuda"))
    named: dict[int, list[tuple[int, int, str]]] = {}
    for gp in audit.graphs:
        named[gp.size] = [(r.start, r.start + r.nbytes, f"{r.kind}") for r in gp.reads]
    per_kernel: dict[str, Any] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter)
    )
    t_dem = 0.0
    for size, g in graphs.items():
        pool, other, freed, live = amap.spans(g.pool())
        tables = [
            ("pool", pool),
            ("other_pool", other),
            ("freed", freed),
            ("live", live),
        ]
        own = named.get(size, [])
        for name, params, blob, exact in kernel_nodes(int(g.raw_cuda_graph())):
            t0 = time.perf_counter()
            dn = demangle(name)
            t_dem += time.perf_counter() - t0
            words = torch.frombuffer(bytearray(blob), dtype=torch.int64) if blob else None
            if words is None:
                continue
            for i, w in enumerate(words.tolist()):
                if i < len(exact) and exact[i] == 1:  # a pointer by its type
                    continue
                off = 8 * i
                pi = next((j for j, (o, n) in enumerate(params) if o <= off < o + n), -1)
                where = "noise"
                for lo, hi, kind in own:
                    if lo <= w < hi:
                        where = "owner:" + kind
                        break
                else:
                    for label, spans in tables:
                        if spans:
                            st, en = spans_of(spans)
                            if int(hit_spans(st, en, torch.tensor([w]))[0]) >= 0:
                                where = label
                                break
                if where == "noise":
                    continue
                po = params[pi][0] if pi >= 0 else 0
                per_kernel[dn][f"p{pi}+{off - po}/{params[pi][1] if pi >= 0 else 0}"][where] += 1
    risky = {
        k: {pos: dict(c) for pos, c in v.items()}
        for k, v in per_kernel.items()
        if any(set(c) & {"freed", "live"} for c in v.values())
    }
    return {
        "tag": tag,
        "graphs": len(graphs),
        "demangle_s": t_dem,
        "audit_unknown": sum(len(g.unknown) for g in audit.graphs),
        "audit_unowned": sum(len(g.unowned) for g in audit.graphs),
        "audit_stale": [list(map(str, s)) for s in audit.stale],
        "audit_undecided": [list(map(str, s)) for s in getattr(audit, "undecided", ())],
        "unknown_words": [
            (g.size, w.kernel[:160], hex(w.address), w.nbytes, w.freed, w.proven)
            for g in audit.graphs
            for w in (*g.unknown, *g.unowned)
        ][:60],
        "kernels_all": sorted(per_kernel)[:400],
        "risky": risky,
    }


def ref_ladder(sanitize: bool, max_size: int) -> tuple[Any, Any]:
    """The reference 1B ladder as ``bench_provenance.py`` builds it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_provenance import runner
    from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

    cfg = LlamaConfig.preset("llama-1b", max_batch=max_size, max_context=512)
    model = LlamaDecodeModel.random(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    sizes = gg.capture_sizes(max_size)
    with torch.inference_mode():
        model.warm_kernels(sizes)
        r = runner(model, sizes, sanitize=sanitize, name=f"ref-{'san' if sanitize else 'def'}")
        r.capture()
    return r, model


class Masked(torch.nn.Module):
    """Memoizes a per-size mask as a plain attribute, rebuilt when the size changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.mask.shape[0] != x.shape[0]:
            self.mask = torch.rand(x.shape[0], 64, device=x.device) > 0.5
        return self.lin(x) * self.mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--parts", default="mask,hf,ref,ref-san")
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--count-only", action="store_true", help="audit counts, no word table")
    args = ap.parse_args()
    parts = args.parts.split(",")
    res: dict[str, Any] = {"torch": torch.__version__}
    out = Path(args.out) / "probe_words.json"

    def dump() -> None:
        out.write_text(json.dumps(res, indent=1, default=str))

    if "mask" in parts:
        for san in (False, True):
            m = Masked().cuda().eval()
            x = torch.randn(8, 64, device="cuda")
            try:
                r = gg.GraphRunner(m, (x,), sizes=[1, 2, 4, 8], progress=False, sanitize=san)
                with torch.no_grad():
                    r.capture()
                a = r.audit()
                res[f"mask-{san}"] = place(
                    r, {s: r.graph(s) for s in r.captured_sizes}, a, f"mask sanitize={san}"
                )
                res[f"mask-{san}"]["check_ok"] = r.check_weights().ok
            except Exception as exc:
                res[f"mask-{san}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print("mask", san, json.dumps(res[f"mask-{san}"], default=str)[:1500], flush=True)
            dump()
    if "hf" in parts:
        import sys

        sys.path.insert(0, "tests")
        import hf_families
        from graphguard.integrations.transformers import GraphedCausalLM

        for fam in hf_families.FAMILIES:
            try:
                model = hf_families.model(fam, device="cuda", dtype=torch.bfloat16)
                g = GraphedCausalLM(model, max_batch=8, max_cache_len=64, progress=False)
                g.capture()
                ids, mask = hf_families.prompts(4)
                g.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=4)
                a = g.runner.audit()
                res[f"hf-{fam}"] = place(
                    g.runner, {s: g.runner.graph(s) for s in g.runner.captured_sizes}, a, fam
                )
            except Exception as exc:
                res[f"hf-{fam}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(fam, json.dumps(res[f"hf-{fam}"], default=str)[:800], flush=True)
            dump()
    for part, san in (("ref", False), ("ref-san", True)):
        if part not in parts:
            continue
        t0 = time.perf_counter()
        try:
            r, model = ref_ladder(san, args.max_size)
            a = r.audit()
            if args.count_only:
                res[part] = {
                    "graphs": len(a.graphs),
                    "unknown": sum(len(g.unknown) for g in a.graphs),
                    "unowned": sum(len(g.unowned) for g in a.graphs),
                    "undecided": [list(map(str, u)) for u in a.undecided],
                    "stale": [list(map(str, u)) for u in a.stale],
                    "dismissed": sum(g.dismissed for g in a.graphs),
                    "words": sum(g.words for g in a.graphs),
                }
            else:
                res[part] = place(r, {s: r.graph(s) for s in r.captured_sizes}, a, part)
            res[part]["seconds"] = time.perf_counter() - t0
            r.release()
            del model
            torch.cuda.empty_cache()
        except Exception as exc:
            res[part] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
        print(part, json.dumps(res[part], default=str)[:3000], flush=True)
        dump()
    dump()


if __name__ == "__main__":
    main()
