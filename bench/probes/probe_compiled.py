"""Where does ``GraphRunner(compile=True)`` spend its compile + capture time?

Reference model at llama-1b shapes (bf16), ``compiled_capture_sizes(256)``: the report's
compile seconds, per-size warmup/capture seconds of the first capture and of a recapture
(compiled code cached), for ``decode_sdpa`` = cudnn and planless; then one
reduce-overhead compile of one batch size for scale. Prints JSON, writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel


def sizes_table(rep: Any) -> list[tuple[int, float, float]]:
    return [(s.size, round(s.warmup_s, 4), round(s.capture_s, 4)) for s in rep.sizes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("probe_compiled.json"))
    ap.add_argument("--sdpa", default="cudnn,planless")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for sdpa in args.sdpa.split(","):
        torch._dynamo.reset()
        cfg = LlamaConfig.preset("llama-1b", max_batch=256, max_context=1024, decode_sdpa=sdpa)
        model = LlamaDecodeModel.random(
            cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0
        )
        with torch.inference_mode():
            model.warm_kernels([256])
            torch.cuda.synchronize()
            runner = gg.GraphRunner(
                model.decode_step,
                model.example_inputs(2),
                compile=True,
                fill_values=model.pad_fill_values(),
                before_capture=[model.warm_kernels],
                workspaces=[model.workspace],
                progress=False,
                name=f"probe.{sdpa}",
                options=gg.CaptureOptions(max_size=256),
            )
            t0 = time.perf_counter()
            rep = runner.capture()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            rep2 = runner.recapture(reason="probe")
            second = time.perf_counter() - t0
            res = {
                "first_wall_s": first,
                "compile_s": rep.compile_s,
                "compiles": rep.compiles,
                "hooks_s": rep.hooks_s,
                "first_sizes_sum_s": sum(s.warmup_s + s.capture_s for s in rep.sizes),
                "first_sizes": sizes_table(rep),
                "recapture_wall_s": second,
                "recapture_sizes_sum_s": sum(s.warmup_s + s.capture_s for s in rep2.sizes),
            }
            x = model.example_inputs(16)
            diff = (runner(*x).float() - model.decode_step(*x).float()).abs().max()
            res["b16_max_abs_diff_vs_eager"] = float(diff)
            runner.release()
        out[sdpa] = res
        print(sdpa, json.dumps({k: v for k, v in res.items() if k != "first_sizes"}), flush=True)
        print(res["first_sizes"][:6], res["first_sizes"][-4:], flush=True)
        del runner, model
    torch._dynamo.reset()
    cfg = LlamaConfig.preset("llama-1b", max_batch=256, max_context=1024)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    with torch.inference_mode():
        model.warm_kernels([256])
        fn = torch.compile(model.decode_step, mode="reduce-overhead", dynamic=False)
        x = model.example_inputs(16)
        t0 = time.perf_counter()
        for _ in range(3):
            fn(*x)
        torch.cuda.synchronize()
        out["reduce_overhead_one_size_s"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}))
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
