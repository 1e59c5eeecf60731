"""transformers integration on real CUDA graphs (issue 12).

For each family (tiny seeded configs, no downloads): float32 greedy generation of 64
tokens for batches of 1, 3 and 8 left-padded prompts of different lengths is
token-identical to HF's eager ``generate`` (static cache with its compile turned off: the
same math; and the default dynamic cache); capture leaves the cache and its counters as
they were; ``sanitize=True`` captures and generates without a report. With
``compile=True`` (Llama, float32) the ladder is captured from one Inductor compile and
batches 1, 3 and 8 stay token-identical to HF eager ``generate``.

Regression (hazard "cuBLAS workspace freed after capture"): at the Llama-3.2-1B shape
(2 layers), after torch drops its cached cuBLAS workspaces -- directly, or through
``torch.compile(mode="reduce-overhead")`` inside HF's static-cache ``generate`` -- the
graphs still replay: before the fix they faulted ("an illegal memory access") because
they had baked a workspace the warmups allocated outside their pool. These run in a
subprocess, so a fault fails one test instead of poisoning the CUDA context of the rest.

Run on the GPU machine: ``python -m pytest tests/gpu/test_hf_gpu.py -rA -s``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from graphguard import GraphRunner
from graphguard.errors import GraphCaptureError
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
    assert type(g.runner) is GraphRunner and g.runner.sanitize
    g.capture()
    ids, mask = F.prompts(3, seed=11, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    got = g.generate(ids, mask, max_new_tokens=NEW)
    want = hf_eager(model, ids, mask, static=True)
    assert torch.equal(got, want)


COMPILED_CASES = [(family, True) for family in F.FAMILIES] + [("llama", "model")]


@pytest.mark.compile
@pytest.mark.parametrize(("family", "compile"), COMPILED_CASES)
def test_compiled_ladder_one_compile_token_identical_float32(family, compile):
    """compile=True (one decoder block for every layer) and compile="model" (the whole
    model call): one Inductor compile serves sizes 2, 4, 8 (batch 1 pads to 2)."""
    model = F.model(family, device="cuda")
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False, compile=compile)
    assert g.compile_scope == ("model" if compile == "model" else "blocks")
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []  # Inductor's output code (also on a cache hit)
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        report = g.capture()
    print(report.summary())
    assert g.captured_sizes == (2, 4, 8), report.table()
    assert report.compiles == 1, report.recompiles
    assert report.recompiles == [] and 0 < report.compile_s <= report.total_s
    # The cache writes stay in place: no buffer of the cache's shape to copy back from.
    _, heads, length, dim = g.cache.layers[0].keys.shape
    full = re.compile(rf"empty_strided_\w+\(\(\w+, {heads}, {length}, {dim}\)")
    assert len(codes) == 1 and not full.findall(codes[0]), full.findall("".join(codes))
    # Reported: transformers' sdpa path takes repeat_kv under dynamo (K/V copied to every
    # query head, per layer and step), where eager decode may pack GQA instead.
    q_heads = model.config.num_attention_heads
    repeat = re.findall(rf"empty_strided_\w+\(\(\w+, {q_heads}, {length}, {dim}\)", codes[0])
    print(f"compiled decode: {len(repeat)} buffers of K/V repeated to {q_heads} heads")
    for batch in BATCHES:
        ids, mask = F.prompts(batch, seed=batch, longest=9)
        ids, mask = ids.cuda(), mask.cuda()
        got = g.generate(ids, mask, max_new_tokens=NEW)
        want = hf_eager(model, ids, mask, static=True)
        same = (got == want).float().mean().item()
        assert torch.equal(got, want), f"compiled, batch {batch}: {same:.2%} of tokens equal"
    assert g.compiled_step is not None and g.compiled_step.compiles == 1


@pytest.mark.compile
def test_compiled_size_one_is_reported():
    """Whether size 1 joins the ladder's compile on this torch (the default ladder leaves it
    out: Inductor may guard ``size >= 2``). Tokens are asserted, the compile count printed."""
    model = F.model("llama", device="cuda", seed=1)
    g = GraphedCausalLM(
        model, max_batch=2, max_cache_len=CACHE, sizes=[1, 2], progress=False, compile=True
    )
    try:
        report = g.capture()
    except GraphCaptureError as exc:  # torch 2.11 failed some size-1 compiles outright
        pytest.skip(f"size 1 did not capture compiled on torch {torch.__version__}: {exc}")
    print(f"sizes [1, 2]: {report.compiles} compile(s); recompiles: {report.recompiles}")
    assert g.captured_sizes == (1, 2), report.table()
    ids, mask = F.prompts(1, seed=2, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    assert torch.equal(
        g.generate(ids, mask, max_new_tokens=NEW), hf_eager(model, ids, mask, static=True)
    )


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


@pytest.mark.compile
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


_WORKSPACE_CASE = r"""
import inspect, sys
import torch, transformers as tf
from graphguard.errors import GraphCaptureError
from graphguard.integrations.transformers import GraphedCausalLM

case = sys.argv[1]
cfg = tf.LlamaConfig(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
    max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
    bos_token_id=1, eos_token_id=None, pad_token_id=0)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
with torch.device("cuda"):
    model = tf.LlamaForCausalLM(cfg)
model = model.to(torch.bfloat16).eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
# The bench's layout: one cache of 32 rows, batch 8 replays over a row view of it.
g = GraphedCausalLM(model, max_batch=32, max_cache_len=1024, sizes=[1, 8, 32], progress=False)
g.capture()
ids = {b: torch.randint(3, 128256, (b, 32), generator=torch.Generator().manual_seed(b)).cuda()
       for b in (1, 8)}
ours = lambda b: g.generate(ids[b], torch.ones_like(ids[b]), max_new_tokens=65)
first = ours(8)
torch.cuda.synchronize()
if case == "clear":
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()  # unmaps a freed workspace: a replay that uses it faults
else:  # the bench's order: HF's reduce-overhead compile at batch 1, HF eager at batch 8
    from transformers import StaticCache
    params = inspect.signature(model.forward).parameters
    kw = "past_key_values" if "past_key_values" in params else "cache"
    cache = StaticCache(config=model.config, max_cache_len=1024)
    model.generate(ids[1], attention_mask=torch.ones_like(ids[1]), do_sample=False,
                   max_new_tokens=66, **{kw: cache})
    model.generate(ids[8], attention_mask=torch.ones_like(ids[8]), do_sample=False,
                   max_new_tokens=66)
    torch.cuda.empty_cache()
after = ours(8)
again = ours(8)
ours(1)
torch.cuda.synchronize()
print("RESULT", torch.equal(after, again), torch.equal(first, after), flush=True)
"""


@pytest.mark.parametrize("case", ["clear", "compile"])
def test_graphs_survive_torch_dropping_its_cublas_workspaces(case):
    """Replays after torch frees its cached cuBLAS workspaces do not fault (they did)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _WORKSPACE_CASE, case],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"case {case!r} failed (rc {proc.returncode}):\n{out[-4000:]}"
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, out[-4000:]
    _, stable, same_as_before = result[-1].split()
    # Reported, not asserted: random bf16 weights have exact top-2 ties, and a run on
    # the H200 saw batch-8 tokens differ after the drop (bitwise reproducibility of bf16
    # generate across workspace re-allocation is not established yet).
    print(
        f"{case}: no fault; two generates after the drop equal: {stable}; "
        f"equal to the one before it: {same_as_before}"
    )


def test_verify_passes_then_catches_a_weight_replaced_after_capture():
    from graphguard.errors import DivergenceError

    model = F.model("llama", device="cuda")
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    g.capture()
    before = _cache(g)
    report = g.verify(rtol=0, atol=0)  # graphs of the eager kernels: bitwise equal
    assert report.ok, report.table()
    assert all(torch.equal(a, b) for a, b in zip(before, _cache(g))), "verify changed the cache"
    # A planted bug: the lm_head replaced (not updated in place) after capture. The graphs
    # still read the old tensor (kept alive here), eager reads the new one.
    old = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(old.detach() * 2)
    with pytest.raises(DivergenceError, match="diverges from eager"):
        g.verify()
    del old


# ----------------------------------------------------------------- bad prompts on the GPU


def test_out_of_range_id_is_refused_and_the_cuda_context_stays_usable():
    """An id >= vocab on CUDA would be a device-side assert in the embedding, which
    poisons the CUDA context for the whole process: refused first (ConfigError naming
    the position), and the next good call still equals HF eager."""
    from graphguard.errors import ConfigError

    model = F.model("llama", device="cuda", seed=2)
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    g.capture()
    ids, mask = F.prompts(3, seed=5, longest=9)
    ids, mask = ids.cuda(), mask.cuda()
    bad = ids.clone()
    bad[2, 7] = 5000
    with pytest.raises(ConfigError, match=r"input_ids\[2, 7\] = 5000"):
        g.generate(bad, mask, max_new_tokens=NEW)
    with pytest.raises(ConfigError, match="integer token ids"):
        g.generate(ids.float(), mask, max_new_tokens=NEW)
    torch.cuda.synchronize()  # would raise "device-side assert triggered" after a bad lookup
    got = g.generate(ids, mask, max_new_tokens=NEW)
    want = hf_eager(model, ids, mask, static=True)
    assert torch.equal(got, want)


def test_right_padded_prompts_equal_hf_on_the_left_padded_equivalent():
    model = F.model("qwen2", device="cuda", seed=3)
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
    g.capture()
    left, lmask = F.prompts(8, seed=6, longest=9)
    pads = (lmask == 0).sum(dim=1).tolist()
    right = torch.stack([torch.roll(r, -p) for r, p in zip(left, pads)])
    rmask = torch.stack([torch.roll(r, -p) for r, p in zip(lmask, pads)])
    left, lmask, right, rmask = (t.cuda() for t in (left, lmask, right, rmask))
    got = g.generate(right, rmask, max_new_tokens=NEW)
    want = hf_eager(model, left, lmask, static=True)
    assert torch.equal(got, want)


def test_model_split_across_cpu_and_gpu_is_refused_naming_the_devices():
    """Was a raw cross-device RuntimeError inside capture; now UnsupportedModelError
    before anything is built, naming both devices and a tensor on each."""
    from graphguard.errors import UnsupportedModelError

    model = F.model("llama", device="cuda")
    model.lm_head.to("cpu")
    ok, reason = GraphedCausalLM.supported(model)
    assert not ok and "cpu: lm_head.weight" in reason and "cuda:0: " in reason, reason
    with pytest.raises(UnsupportedModelError, match="several devices"):
        GraphedCausalLM(model, max_batch=8, max_cache_len=CACHE, progress=False)
