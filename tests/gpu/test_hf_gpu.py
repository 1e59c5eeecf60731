"""transformers integration on real CUDA graphs (issue 12).

For each family (tiny seeded configs, no downloads): float32 greedy generation of 64
tokens for batches of 1, 3 and 8 left-padded prompts of different lengths is
token-identical to HF's eager ``generate`` (static cache with its compile turned off: the
same math; and the default dynamic cache); capture leaves the cache and its counters as
they were; ``sanitize=True`` captures and generates without a report.

Run on the GPU machine: ``python -m pytest tests/gpu/test_hf_gpu.py -rA -s``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from graphguard.integrations.transformers import GraphedCausalLM
from tests import hf_families as F

CACHE = 128
NEW = 64
BATCHES = (1, 3, 8)


def hf_eager(model, ids, mask, *, static: bool):
    kw = {"cache_implementation": "static", "disable_compile": True} if static else {}
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kw)


def _cache(g):
    return [
        t.clone()
        for layer in g.cache.layers
        for t in (layer.keys, layer.values, layer.cumulative_length)
    ]


@pytest.mark.parametrize("family", F.FAMILIES)
def test_greedy_64_tokens_equal_hf_eager_generate_float32(family):
    model = F.model(family, device="cuda")
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    with torch.no_grad():
        for layer in g.cache.layers:  # capture must give back whatever the cache holds
            layer.keys.normal_()
            layer.cumulative_length.fill_(5)
    before = _cache(g)
    report = g.capture()
    assert all(torch.equal(a, b) for a, b in zip(before, _cache(g))), "capture changed the cache"
    assert g.captured_sizes == (1, 2, 4, 8), report.table()
    for batch in BATCHES:
        ids, mask = F.prompts(batch, seed=batch, longest=9)
        ids, mask = ids.cuda(), mask.cuda()
        got = g.generate(ids, mask, max_new_tokens=NEW)
        for static in (True, False):
            want = hf_eager(model, ids, mask, static=static)
            same = (got == want).float().mean().item()
            assert torch.equal(got, want), (
                f"{family} batch {batch} ({'static' if static else 'dynamic'} cache): "
                f"{same:.2%} of tokens equal"
            )
    print(f"{family}: batches {BATCHES} x {NEW} tokens token-identical to HF eager generate")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_sanitized_capture_and_generation_report_nothing(family):
    model = F.model(family, device="cuda")
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False, sanitize=True)
    assert type(g.runner).__name__ == "SanitizingGraphRunner"
    g.capture()
    ids, mask = F.prompts(3, seed=11, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    got = g.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(got, hf_eager(model, ids, mask, static=True))


def test_bf16_agreement_is_reported():
    """bf16 with random weights has exact top-2 ties, so agreement is measured, not asserted."""
    model = F.model("llama", device="cuda", dtype=torch.bfloat16)
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    g.capture()
    ids, mask = F.prompts(8, seed=3, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    got = g.generate(ids, mask, max_new_tokens=NEW)
    want = hf_eager(model, ids, mask, static=True)
    agree = (got == want).float()[:, ids.shape[1] :].mean().item()
    print(f"bf16 llama batch 8: {agree:.2%} of new tokens equal HF eager generate")
    assert got.shape == want.shape


def test_eos_and_sampling_on_the_gpu():
    model = F.model("qwen3", device="cuda")
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    g.capture()
    ids, mask = F.prompts(3, seed=4, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    free = hf_eager(model, ids, mask, static=True)
    eos = int(free[1, ids.shape[1] + 5])
    want = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=0,
        cache_implementation="static",
        disable_compile=True,
    )
    got = g.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    kw = {"do_sample": True, "temperature": 0.8, "top_k": 30, "top_p": 0.95}
    a = g.generate(
        ids, mask, max_new_tokens=NEW, generator=torch.Generator("cuda").manual_seed(1), **kw
    )
    b = g.generate(
        ids, mask, max_new_tokens=NEW, generator=torch.Generator("cuda").manual_seed(1), **kw
    )
    assert torch.equal(a, b)
