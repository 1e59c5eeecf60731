"""Why ``bench_rl_loop.py`` zeroes HF's paged cache before HF's warmup, shown on a CPU.

HF's warmup step (``ModelRunner.run_one_warmup``) prefills a synthetic request over a
past that no request wrote. Where the paged cache holds NaN bit patterns there (what
``torch.empty`` may hand back: transformers 5.17 allocates it so), sampling fails with
torch's "probability tensor contains either inf, nan or element < 0" (on CUDA a device
assert that ends the process; here a RuntimeError that HF's warmup catches and logs);
with the cache zeroed the same step runs. Prints one line per fill.

``PYTHONPATH=src:ref/src python bench/hf_warmup_cache.py`` (a few seconds; the tiny Llama
of ``examples/grpo_continuous_batching.py``; transformers 5.17 or 5.2x layouts).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rl_loop as b


class _Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Failed to warm up" in record.getMessage():
            self.lines.append(record.getMessage().splitlines()[0])


def main() -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    ex = b.ex
    cfg = ex.LoopConfig(device="cpu", prompts=4, samples=2, max_batch_tokens=64, num_blocks=8)
    model = ex.build_model(cfg, 0).eval()
    seen = _Failures()
    logging.getLogger("ContinuousBatchingLogger").addHandler(seen)
    for name, value in (("NaN", float("nan")), ("zeros", 0.0)):
        model.destroy_cached_continuous_batching_manager()
        manager = model.init_continuous_batching(
            generation_config=ex.generation_config(cfg),
            continuous_batching_config=ex.batching_config(cfg, use_cuda_graph=False),
            workload_hints=WorkloadHints(
                max_prompt_length=12, max_generated_length=8, num_requests=8
            ),
        )
        manager.batch_processor = manager._create_batch_processor()
        cache = manager.batch_processor.cache
        kv = [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]
        with torch.no_grad():
            if kv:  # 5.17: one key and one value tensor per layer group
                for t in kv:
                    t.fill_(value)
            else:  # 5.2x: one byte tensor (0xFF bytes are NaN in every float format)
                cache.cache_tensor.fill_(255 if value != 0 else 0)
            seen.lines.clear()
            runner = manager.batch_processor.model_runner
            runner.run_one_warmup(model, cache.max_batch_tokens, 16)  # a past of 16 tokens
        print(f"paged cache filled with {name}: " + (seen.lines[0] if seen.lines else "ran"))
    model.destroy_cached_continuous_batching_manager()


if __name__ == "__main__":
    main()
