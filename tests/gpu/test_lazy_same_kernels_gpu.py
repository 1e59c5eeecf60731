"""A size captured lazily launches the same kernels, in the same order, as the same size
captured at start-up, and gives bitwise equal outputs.

Why: a lazy capture runs later, outside ``capture()``; if anything graphguard or torch sets
around a start-up capture (autocast, cuBLAS and cuDNN settings, the before-capture hooks'
effects) did not hold then, the lazy graph would bake other kernels, and per-shape speed
(or numerics) would depend on which sizes happened to be captured when (the hazard a review
of TensorRT-LLM's lazy capture found). Each graph is dumped as DOT (``CudaBackend(
debug_dump_dir=...)``); kernel nodes are compared in order with their raw addresses
masked (the two runners' buffers differ).

Run on the GPU machine: ``python -m pytest tests/gpu/test_lazy_same_kernels_gpu.py -rA -s``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import CudaBackend

SIZES = [1, 4, 8, 16, 24, 32]
LAZY = [True, gg.Lazy(warm_shapes=True)]
"""Each lazy test twice: the default (a size's first call, run eagerly on the default
stream, stands for the capture's warmup), and ``warm_shapes`` (the stage's forward does:
no eager forward right before the capture either way)."""
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
NODE = re.compile(r'"?(graph_\d+_node_\d+)"?\s*\[(.*?)\];?\s*$', re.S | re.M)


def kernels(dot: Path) -> list[str]:
    """Each kernel node's attributes in the dump's order, addresses masked."""
    text = dot.read_text()
    out = []
    for _, attrs in NODE.findall(text):
        if "KERNEL" in attrs.upper():
            out.append(ADDRESS.sub("0x", " ".join(attrs.split())))
    return out


def compare(start_dir: Path, lazy_dir: Path, sizes: list[int]) -> None:
    for size in sizes:
        a, b = start_dir / f"graph_{size}.dot", lazy_dir / f"graph_{size}.dot"
        if not (a.exists() and b.exists()):
            pytest.skip(f"CUDAGraph.debug_dump wrote no DOT for size {size} on this torch")
        ka, kb = kernels(a), kernels(b)
        assert ka, f"no kernel node parsed from {a}: {a.read_text()[:500]}"
        if ka != kb:
            first = next(
                (i for i, (x, y) in enumerate(zip(ka, kb)) if x != y), min(len(ka), len(kb))
            )
            one = ka[first][:400] if first < len(ka) else "-"
            two = kb[first][:400] if first < len(kb) else "-"
            pytest.fail(
                f"size {size}: start-up graph has {len(ka)} kernels, lazy {len(kb)}; first "
                f"difference at kernel {first}:\n  start-up: {one}\n  lazy:     {two}"
            )
        print(f"[same-kernels] size {size}: {len(ka)} kernels, same order", flush=True)


@pytest.mark.parametrize("lazy_opt", LAZY, ids=["warmup", "warm_shapes"])
@torch.inference_mode()
def test_reference_step_lazy_graphs_equal_start_up_graphs(tmp_path: Path, lazy_opt: Any) -> None:
    from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

    cfg = LlamaConfig.preset("llama-1b", max_batch=32, max_context=512)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    gen = torch.Generator().manual_seed(3)
    inputs = {n: model.example_inputs(n, generator=gen) for n in SIZES}

    def runner(kind: str, **kw: Any) -> gg.GraphRunner:
        return gg.GraphRunner(
            model.decode_step,
            model.example_inputs(2),
            sizes=SIZES,
            fill_values=model.pad_fill_values(),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            state=[],
            progress=False,
            name=kind,
            backend=CudaBackend(debug_dump_dir=str(tmp_path / kind)),
            **kw,
        )

    start = runner("start")
    start.capture()
    lazy = runner("lazy", lazy=lazy_opt)
    lazy.capture()
    for n in SIZES:
        # Back to back on the same cache: the step writes its rows' K/V (the same values,
        # twice) and reads what the last calls left, so both calls see the same state.
        # By default the first lazy call is the eager warmup, the second the capture.
        for _ in range(2 if lazy_opt is True else 1):
            want = start(*inputs[n]).clone()
            got = lazy(*inputs[n])
            assert torch.equal(got, want), f"size {n}: lazy output differs bitwise"
    assert lazy.captured_sizes == tuple(SIZES)
    assert all(s.prewarmed and s.warmups == 0 for s in lazy.stats().sizes)
    compare(tmp_path / "start", tmp_path / "lazy", SIZES)


@pytest.mark.parametrize("lazy_opt", LAZY, ids=["warmup", "warm_shapes"])
@torch.inference_mode()
def test_hf_decode_lazy_graphs_equal_start_up_graphs(tmp_path: Path, lazy_opt: Any) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphguard.integrations.transformers import GraphedCausalLM

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    sizes = [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(4)
    ids = {b: torch.randint(3, 4096, (b, 12), generator=gen).cuda() for b in sizes}

    def graphed(kind: str, **kw: Any) -> GraphedCausalLM:
        return GraphedCausalLM(
            model,
            max_batch=8,
            max_cache_len=64,
            sizes=sizes,
            progress=False,
            backend=CudaBackend(debug_dump_dir=str(tmp_path / kind)),
            **kw,
        )

    start = graphed("start")
    start.capture()
    want = {b: start.generate(ids[b], torch.ones_like(ids[b]), max_new_tokens=4) for b in sizes}
    start.release()
    lazy = graphed("lazy", lazy=lazy_opt)
    lazy.capture()
    for b in sizes:
        got = lazy.generate(ids[b], torch.ones_like(ids[b]), max_new_tokens=4)
        assert torch.equal(got, want[b]), f"batch {b}: lazy tokens differ from start-up's"
    compare(tmp_path / "start", tmp_path / "lazy", sorted(lazy.captured_sizes))
