"""transformers integration on CPU: generation equals HF's, capture restores the cache,
warmup takes capture's path, every unsupported configuration is refused by name,
``generate`` checks its ids, mask and settings like HF's ``generate`` (each bad input named,
then a good call equal to HF's), and ``compile=True`` captures the whole ladder from one
Inductor compile.

The compiled tests compile two families once each (module fixtures, ~15-35 s apiece
with a cold Inductor cache on two CPU cores); every compiled test reads those."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode

import graphguard as gg
from graphguard import phase
from graphguard.errors import ConfigError, GraphGuardError, UnsupportedModelError
from graphguard.integrations import _hf_support
from graphguard.integrations.transformers import GraphedCausalLM
from tests import hf_families as F

CACHE = 40
NEW = 10


def hf_generate(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return model.generate(
        ids,
        attention_mask=mask,
        do_sample=kw.pop("do_sample", False),
        cache_implementation="static",
        **kw,
    )


def graphed(model, *, mode="full", max_batch=4, **kw):
    g = GraphedCausalLM(
        model,
        max_batch=max_batch,
        max_cache_len=CACHE,
        mode=mode,
        backend=gg.RecordingBackend() if mode == "full" else None,
        progress=False,
        **kw,
    )
    g.capture()
    return g


@pytest.mark.parametrize("family", F.FAMILIES)
@pytest.mark.parametrize("mode", ["full", "none"])
def test_generate_equals_hf_static_generate(family, mode):
    """Greedy tokens equal HF's, batch 1 and 3 left-padded prompts of different lengths."""
    model = F.model(family)
    g = graphed(model, mode=mode)
    for batch in (1, 3):
        ids, mask = F.prompts(batch, seed=batch)
        want = hf_generate(model, ids, mask)
        got = g.generate(ids, mask, max_new_tokens=NEW)
        assert torch.equal(got, want), (family, batch, got, want)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eager_attention_equals_hf(family):
    model = F.model(family, attn="eager")
    g = graphed(model)
    ids, mask = F.prompts(3, seed=5)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


def test_batches_pad_to_captured_sizes_and_reuse_rows():
    """Batch 3 replays the size-4 graph over rows [0, 4); 1 then 4 then 3 again still match."""
    model = F.model("llama", seed=3)
    backend = gg.RecordingBackend()
    g = GraphedCausalLM(model, max_batch=4, max_cache_len=CACHE, backend=backend, progress=False)
    g.capture()
    assert g.captured_sizes == (1, 2, 4)
    for batch in (1, 4, 3, 2):
        ids, mask = F.prompts(batch, seed=10 + batch)
        before = len(backend.events)
        got = g.generate(ids, mask, max_new_tokens=NEW)
        assert torch.equal(got, hf_generate(model, ids, mask)), batch
        replays = {e[1] for e in backend.events[before:] if e[0] == "replay"}
        assert replays == {g.runner.padded_size(batch)}


def test_eos_pads_finished_rows_and_trims_like_hf():
    model = F.model("qwen2", seed=1)
    ids, mask = F.prompts(3, seed=2)
    free = hf_generate(model, ids, mask, max_new_tokens=30, eos_token_id=None)
    prompt = ids.shape[1]
    # EOS = the 3rd new token of row 0: row 0 stops early, the others pad after their EOS.
    eos = int(free[0, prompt + 2])
    g = graphed(model, stop_check_every=4)
    for max_new in (30, 5):
        want = hf_generate(
            model, ids, mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0
        )
        got = g.generate(ids, mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, want), (got, want)
    # Every row finishing trims the output, as generate does.
    one = ids[:1], mask[:1]
    want = hf_generate(model, *one, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    got = g.generate(*one, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert got.shape[1] == prompt + 3
    assert torch.equal(got, want)


class _SyncCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_decode_reads_the_host_only_every_stop_check_steps():
    model = F.model("llama", seed=5)
    g = graphed(model, stop_check_every=4)
    ids, mask = F.prompts(2, seed=8)
    never = 100  # not in the vocabulary's greedy path: EOS checks run, nothing finishes
    counts = {}
    for new in (1, 30):
        with _SyncCount() as c:
            g.generate(ids, mask, max_new_tokens=new, eos_token_id=never, pad_token_id=0)
        counts[new] = c.syncs
    assert counts[30] - counts[1] == 7  # steps 4, 8, ..., 28: one "all finished?" read each


def test_seeded_sampling_matches_hf_and_is_reproducible():
    model = F.model("llama", seed=4)
    g = graphed(model)
    ids, mask = F.prompts(3, seed=6)
    kw = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    torch.manual_seed(123)
    want = hf_generate(model, ids, mask, do_sample=True, **kw)
    torch.manual_seed(123)
    got = g.generate(ids, mask, max_new_tokens=NEW, do_sample=True, **kw)
    assert torch.equal(got, want)
    a = g.generate(
        ids,
        mask,
        max_new_tokens=NEW,
        do_sample=True,
        generator=torch.Generator().manual_seed(7),
        **kw,
    )
    b = g.generate(
        ids,
        mask,
        max_new_tokens=NEW,
        do_sample=True,
        generator=torch.Generator().manual_seed(7),
        **kw,
    )
    assert torch.equal(a, b)


def _cache_tensors(g):
    out = []
    for layer in g.cache.layers:
        out += [layer.keys.clone(), layer.values.clone(), layer.cumulative_length.clone()]
    return out


def test_capture_leaves_cache_and_counters_unchanged():
    model = F.model("mistral", seed=2)
    g = GraphedCausalLM(
        model,
        max_batch=4,
        max_cache_len=CACHE,
        backend=gg.RecordingBackend(),
        progress=False,
        options=gg.CaptureOptions(warmup_iters=2),
    )
    ids, mask = F.prompts(4, seed=3)
    # Put the cache mid-generation: nonzero rows everywhere and counters at 9.
    with torch.no_grad():
        for layer in g.cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
            layer.cumulative_length.fill_(9)
    before = _cache_tensors(g)
    addresses = [layer.keys.data_ptr() for layer in g.cache.layers]
    g.capture()
    g.recapture(reason="test: weights reloaded")
    g.estimate_graph_memory()
    after = _cache_tensors(g)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert addresses == [layer.keys.data_ptr() for layer in g.cache.layers]
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


def test_verify_compares_every_size_from_the_same_cache_state_and_leaves_the_cache():
    model = F.model("llama", seed=4)
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=CACHE, backend=gg.RecordingBackend(), progress=False
    )
    with pytest.raises(GraphGuardError, match="capture"):
        g.verify()
    g.capture()
    # Mid-generation: the write position is 9, rows hold data. Without verify restoring the
    # cache between the replay and the eager forward, eager would attend one more column.
    with torch.no_grad():
        for layer in g.cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
            layer.cumulative_length.fill_(9)
    before = _cache_tensors(g)
    report = g.verify(rtol=0, atol=0)
    assert report.ok and [c.size for c in report.sizes] == list(g.captured_sizes)
    assert all(torch.equal(a, b) for a, b in zip(before, _cache_tensors(g)))
    ids, mask = F.prompts(3, seed=5)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _capturing(on: bool) -> Iterator[None]:
    """Make transformers' is_tracing() see a capturing stream (test-only patch)."""
    if not on:
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    try:
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("family", F.FAMILIES)
def test_warmup_and_capture_take_the_same_path(family):
    """The decode step runs the same aten ops whether or not HF thinks a stream captures."""
    model = F.model(family)
    g = GraphedCausalLM(model, max_batch=2, max_cache_len=CACHE, mode="none", progress=False)
    inputs = (
        torch.tensor([[5], [6]]),
        torch.tensor([[3], [4]]),
        torch.ones(2, CACHE, dtype=torch.bool),
    )
    logs, outs = [], []
    for capturing in (False, True):
        for layer in g.cache.layers:
            layer.cumulative_length.fill_(4)
        with _capturing(capturing), phase.enter(phase.Phase.CAPTURE), _OpLog() as log:
            outs.append(g._step(*inputs).clone())
        logs.append(log.ops)
    assert logs[0] == logs[1]
    assert torch.equal(outs[0], outs[1])
    assert not any("item" in op or "_local_scalar_dense" in op for op in logs[0])


def test_capture_declares_its_state_and_warns_nothing(caplog):
    """The cache writes of warmups are restored by GraphedCausalLM (state=[] declared):
    the runner's undeclared-write watch stays off, so no warning at capture."""
    model = F.model("llama", seed=6)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        graphed(model)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_sanitized_capture_reports_nothing():
    model = F.model("llama")
    g = graphed(model, sanitize=True)
    ids, mask = F.prompts(3)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("family", "overrides", "attn", "needle"),
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
            "sdpa",
            "'dynamic'",
        ),
        ("mistral", {"sliding_window": 16}, "sdpa", "sliding window 16 < max_cache_len 40"),
        ("llama", {}, "flash_attention_2", "attention implementation 'flash_attention_2'"),
        ("llama", {}, "flex_attention", "attention implementation 'flex_attention'"),
    ],
)
def test_unsupported_configs_are_refused_with_the_reason(family, overrides, attn, needle):
    model = F.model(family, **overrides)
    model.config._attn_implementation = attn  # as if loaded with attn_implementation=attn
    ok, reason = GraphedCausalLM.supported(model, max_cache_len=CACHE)
    assert not ok and needle in reason
    with pytest.raises(UnsupportedModelError, match=r"model\.generate") as err:
        GraphedCausalLM(model, max_batch=2, max_cache_len=CACHE)
    assert any(needle in r for r in err.value.reasons)


def test_longrope_moe_training_encoder_decoder_are_refused():
    import transformers as tf

    phi = F.config(
        "phi3",
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    )
    moe = tf.MixtralConfig(**{k: v for k, v in F._DIMS.items()}, num_local_experts=4)
    for cfg, needle in ((phi, "'longrope'"), (moe, "mixture of experts")):
        cfg._attn_implementation = "sdpa"
        m = tf.AutoModelForCausalLM.from_config(cfg).eval()
        ok, reason = GraphedCausalLM.supported(m, max_cache_len=CACHE)
        assert not ok and needle in reason, reason
    train = F.model("llama").train()
    assert "call model.eval()" in GraphedCausalLM.supported(train).reason
    t5 = tf.T5ForConditionalGeneration(
        tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=50)
    ).eval()
    assert "encoder-decoder" in GraphedCausalLM.supported(t5).reason


def test_transformers_outside_the_range_is_refused(monkeypatch):
    import transformers as tf

    monkeypatch.setattr(tf, "__version__", "4.57.1")
    ok, reason = GraphedCausalLM.supported(F.model("llama"))
    assert not ok and ">=5.17,<6.0" in reason
    assert _hf_support.version_problem("5.17.0") is None
    assert _hf_support.version_problem("5.24.0.dev0") is None
    assert _hf_support.version_problem("6.0.0") is not None


def test_bad_generate_arguments_are_config_errors():
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2)
    with pytest.raises(ConfigError, match="batch 5"):
        g.generate(torch.ones(5, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ConfigError, match="does not fit max_cache_len 40"):
        g.generate(ids, mask, max_new_tokens=CACHE)
    with pytest.raises(ConfigError, match="attention_mask"):
        g.generate(ids, {"full_attention": mask}, max_new_tokens=2)
    model.generation_config.repetition_penalty = 1.3  # set after construction: refused at use
    with pytest.raises(UnsupportedModelError, match=r"repetition_penalty=1\.3"):
        g.generate(ids, mask, max_new_tokens=2)
    with pytest.raises(ConfigError, match="warmup_iters must be an int >= 1"):
        GraphedCausalLM(
            model, max_batch=2, max_cache_len=CACHE, options=gg.CaptureOptions(warmup_iters=0)
        )
    with pytest.raises(ConfigError, match="<= max_batch"):
        GraphedCausalLM(model, max_batch=2, max_cache_len=CACHE, sizes=[1, 4], mode="none")


def test_generate_refuses_weights_moved_since_capture_and_recapture_fixes_it():
    """A replaced parameter would leave the graphs reading freed memory: refused by name."""
    from graphguard.errors import WeightsMovedError

    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2, seed=5)
    want = hf_generate(model, ids, mask)
    with torch.no_grad():  # in place: same addresses, still allowed
        model.lm_head.weight.copy_(model.lm_head.weight)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), want)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(WeightsMovedError, match=r"(?s)lm_head\.weight.*recapture"):
        g.generate(ids, mask, max_new_tokens=NEW)
    g.recapture(reason="lm_head replaced")
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), want)


# ----------------------------------------------------------------- compile=True

COMPILED_BATCH = 8


def _compiled(
    family: str, compile: bool | str = True
) -> Iterator[tuple[GraphedCausalLM, gg.CaptureReport, list[str]]]:
    # transformers registers every model class it builds in a global dict whose length
    # the compiled forward guards on: a class first built after the compile (the other
    # family here) would recompile it. Build both first. No dynamo reset either: it
    # would drop the other family's compiled code mid-module.
    for other in ("llama", "gpt2"):
        F.model(other)
    # compile="model" traces every layer: one is enough to show one compile for the call.
    layers = {"num_hidden_layers": 1} if compile == "model" else {}
    model = F.model(family, seed=7, **layers)
    g = GraphedCausalLM(
        model,
        max_batch=COMPILED_BATCH,
        max_cache_len=CACHE,
        backend=gg.RecordingBackend(),
        progress=False,
        compile=compile,
    )
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []  # Inductor's output code (also on a cache hit)
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        report = g.capture()
    yield g, report, codes
    phase.reset()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def compiled_llama() -> Iterator[tuple[GraphedCausalLM, gg.CaptureReport, list[str]]]:
    yield from _compiled("llama")


@pytest.fixture(scope="module")
def compiled_gpt2() -> Iterator[tuple[GraphedCausalLM, gg.CaptureReport, list[str]]]:
    yield from _compiled("gpt2")


@pytest.fixture(scope="module")
def compiled_llama_model() -> Iterator[tuple[GraphedCausalLM, gg.CaptureReport, list[str]]]:
    """compile="model": the whole model call in one compile."""
    yield from _compiled("llama", "model")


@pytest.fixture(params=["llama", "gpt2", "llama_model"])
def compiled(request):
    return request.getfixturevalue(f"compiled_{request.param}")


@pytest.mark.compile
def test_compiled_ladder_is_captured_from_one_compile(compiled):
    g, report, _ = compiled
    assert g.captured_sizes == (2, 4, 8)  # compiled_capture_sizes(8): batch 1 pads to 2
    assert g.compiled_step is not None and g.compiled_step.compiles == 1
    assert report.compiles == 1 and report.recompiles == [], report.recompiles
    assert 0 < report.compile_s <= report.total_s
    assert "compiling" in report.summary()


def test_compiled_cache_writes_stay_in_place(compiled):
    """The compiled step writes the new column into the cache views themselves: no buffer
    of the cache's shape is allocated and copied back (a functionalized copy-back of the
    whole cache every step would cost more than the fusion gains)."""
    g, _, codes = compiled
    assert len(codes) == 1, len(codes)
    _, heads, length, dim = g.cache.layers[0].keys.shape
    full = re.compile(rf"empty_strided_\w+\(\(\w+, {heads}, {length}, {dim}\)")
    assert not full.findall(codes[0])
    assert ".copy_(" not in codes[0]
    assert "index_copy" in codes[0]  # the write is fused into a kernel


@pytest.mark.compile
def test_compiled_generate_equals_hf_static_generate(compiled):
    """Batch 1 replays the size-2 graph, batch 3 the size-4 one; the CPU emulation's
    replays run the compiled decode (as a real graph replays its kernels)."""
    g, _, _ = compiled
    step = g.compiled_step
    assert step is not None
    calls = {"n": 0}
    inner = step._compiled

    def counting(*args, **kwargs):
        calls["n"] += 1
        return inner(*args, **kwargs)

    step._compiled = counting
    backend = g.runner.backend
    try:
        for batch, size in ((1, 2), (3, 4)):
            ids, mask = F.prompts(batch, seed=20 + batch)
            before = len(backend.events)
            got = g.generate(ids, mask, max_new_tokens=NEW)
            assert torch.equal(got, hf_generate(g.model, ids, mask)), (batch, got)
            assert {e[1] for e in backend.events[before:] if e[0] == "replay"} == {size}
    finally:
        step._compiled = inner
    # Every decode step ran the compiled code: each block once (compile=True picks the
    # decoder block here), or the model call once.
    blocks = g.model.config.num_hidden_layers if g.compile_scope == "blocks" else 1
    assert calls["n"] == 2 * (NEW - 1) * blocks
    assert step.compiles == 1, step.recompile_reasons


def test_compiled_recompile_after_capture_raises_and_recapture_reuses_the_compile(
    compiled_llama,
):
    g, _, _ = compiled_llama
    ids, mask = F.prompts(3, seed=30)
    attn = g.model.model.layers[0].self_attn
    scaling = attn.scaling
    phase.set_serving()
    attn.scaling = scaling * 2  # a Python float the compiled graph baked in
    try:
        with pytest.raises(GraphGuardError, match="recompile while serving") as err:
            g.generate(ids, mask, max_new_tokens=NEW)
        assert "scaling" in str(err.value)
    finally:
        attn.scaling = scaling
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(g.model, ids, mask))
    report = g.recapture(reason="test: same model, same compile")
    assert report.compiles == 1 and g.compiled_step is not None
    assert g.compiled_step.compiles == 1


def _captured_under_recompile_limit_1(
    compile: bool | str, seed: int
) -> tuple[Any, GraphedCausalLM, gg.CaptureReport]:
    """A Mistral captured with ``compile`` after another instance compiled (the fixture)."""
    model = F.model("mistral", seed=seed)
    with torch._dynamo.config.patch(recompile_limit=1):
        g = GraphedCausalLM(
            model,
            max_batch=4,
            max_cache_len=CACHE,
            backend=gg.RecordingBackend(),
            progress=False,
            compile=compile,
        )
        return model, g, g.capture()


def test_compile_that_dynamo_refuses_is_reported(compiled_llama_model, caplog):
    """compile="model": past dynamo's recompile limit (every instance compiles the same
    function), dynamo runs the step eagerly: the graphs hold eager kernels, and capture
    says so."""
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        model, g, report = _captured_under_recompile_limit_1("model", seed=2)
    assert g.compile_scope == "model"
    assert report.compiles == 0 and "recompile_limit" in caplog.text
    ids, mask = F.prompts(3, seed=9)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


@pytest.mark.compile
def test_block_compile_is_per_instance_and_leaves_the_model_unchanged(compiled_llama):
    """compile=True compiles one decoder block for every layer and size. Each instance
    compiles its own copy of the code, so a second one (of another family, under a
    recompile limit of 1) still compiles; outside graphguard's calls the blocks have no
    forward of their own and the model generates as before."""
    model, g, report = _captured_under_recompile_limit_1(True, seed=3)
    assert g.compile_scope == "blocks" and report.compiles == 1, report.recompiles
    assert g.compiled_step is not None and "MistralDecoderLayer" in g.compiled_step.name
    ids, mask = F.prompts(3, seed=5)
    want = hf_generate(model, ids, mask)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), want)
    assert not [b for b in model.model.layers if "forward" in vars(b)]
    assert torch.equal(hf_generate(model, ids, mask), want)


def test_one_layer_cache_writes_its_layer_whatever_index_it_is_given():
    """What lets one compiled block serve every layer: the block's cache ignores the
    layer index attention passes and writes the block's own layer, in place."""
    from graphguard.integrations._hf_blocks import one_layer_cache
    from graphguard.integrations._hf_cache import RowViews, build_cache

    model = F.model("llama", seed=4)
    cache = build_cache(model, 4, CACHE, _hf_support.cache_kwarg(model) or "cache")
    view = RowViews(cache)(2)
    one = one_layer_cache(view, 1)
    assert isinstance(one, type(view)) and one.layers is view.layers  # other methods unchanged
    heads, dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    k = torch.randn(2, heads, 1, dim)
    keys, _ = one.update(k, -k, 0)  # layer_idx 0 is ignored
    assert keys.data_ptr() == cache.layers[1].keys.data_ptr()
    assert torch.equal(cache.layers[1].keys[:2, :, 0], k[:, :, 0])
    assert torch.equal(cache.layers[1].values[:2, :, 0], -k[:, :, 0])
    assert not cache.layers[0].keys.any() and int(cache.layers[0].cumulative_length) == 0
    assert int(cache.layers[1].cumulative_length) == 1  # the alias advanced the real counter


@pytest.mark.compile
def test_compile_blocks_needs_a_decoder_block(caplog):
    """compile="blocks" on a model that declares no block is refused with the reason;
    compile=True compiles the whole model call instead and says why."""
    model = F.model("llama", seed=5)
    kw = {"max_batch": 4, "max_cache_len": CACHE, "progress": False}
    with mock.patch.object(model, "_no_split_modules", set()):
        with pytest.raises(ConfigError, match=r"declares no decoder block.*compile='model'"):
            GraphedCausalLM(model, **kw, compile="blocks")
        with caplog.at_level(logging.INFO, logger="graphguard"):
            g = GraphedCausalLM(model, **kw, compile=True, backend=gg.RecordingBackend())
    assert g.compile_scope == "model" and "whole model call" in caplog.text
    model.model.layers[0].forward = model.model.layers[0].forward  # e.g. a hook library's
    with pytest.raises(ConfigError, match="its own forward attribute"):
        GraphedCausalLM(model, **kw, compile="blocks")


@pytest.mark.compile
def test_compile_arguments_are_checked_and_nothing_compiles_eagerly(caplog):
    model = F.model("llama")
    kw = {"max_batch": 8, "max_cache_len": CACHE, "progress": False}
    for bad, needle in (
        ({"compile": "yes"}, "compile must be one of"),
        ({"compile": True, "compile_mode": "reduce-overhead"}, "Inductor's own CUDA graphs"),
        ({"compile": True, "compile_mode": "fast"}, "compile_mode='fast'"),
        ({"compile_mode": "max-autotune-no-cudagraphs"}, "needs compile=True"),
    ):
        with pytest.raises(ConfigError, match=needle):
            GraphedCausalLM(model, **kw, **bad)
    g = GraphedCausalLM(model, **kw, compile=True, backend=gg.RecordingBackend())
    assert g.runner.sizes == (2, 4, 8)
    with caplog.at_level(logging.INFO, logger="graphguard"):
        g1 = GraphedCausalLM(model, **kw, compile=True, sizes=[1, 8], backend=gg.RecordingBackend())
    assert g1.runner.sizes == (1, 8) and "size 1" in caplog.text
    # mode="none": the same loop eagerly, nothing compiled.
    eager = GraphedCausalLM(model, **kw, compile=True, mode="none")
    eager.capture()
    ids, mask = F.prompts(3, seed=4)
    assert torch.equal(eager.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))
    assert eager.compiled_step is not None and eager.compiled_step.compiles == 0


def _falcon_like_split(fused: torch.Tensor) -> torch.Tensor:
    # What capture raises where a forward indexes with a Python list (a host index copied
    # to the GPU), e.g. Falcon's multi-query _split_heads.
    raise RuntimeError(
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
        "tensor is pinned."
    )


@pytest.mark.compile
def test_capture_that_fails_on_a_host_copy_is_a_refusal_naming_the_line():
    model = F.model("llama", seed=6)
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=CACHE, progress=False, backend=gg.RecordingBackend()
    )
    g.capture()  # a ladder to drop: nothing may stay half-captured

    def failing(*_args, **_kwargs):
        try:
            _falcon_like_split(torch.zeros(1))
        except RuntimeError as cause:
            raise gg.errors.GraphCaptureError(
                "capturing size 4 failed", size=4, cause=cause
            ) from cause

    with mock.patch.object(g.runner, "recapture", failing):
        with pytest.raises(UnsupportedModelError, match="copies a host tensor") as err:
            g.recapture(reason="test")
    assert "test_hf_integration.py" in str(err.value) and "_falcon_like_split" in str(err.value)
    assert "compile=True" in str(err.value) and "model.generate" in str(err.value)
    assert g.captured_sizes == ()
    other = gg.errors.GraphCaptureError(
        "size 4 failed", size=4, cause=RuntimeError("CUDA error: x")
    )
    with mock.patch.object(g.runner, "capture", mock.Mock(side_effect=other)):
        with pytest.raises(gg.errors.GraphCaptureError):
            g.capture()


# ----------------------------------------------------------------- generate validates like HF


def _right_padded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The right-padded equivalent of left-padded prompts: each row rolled left by its pad."""
    rows = [
        (torch.roll(i, -int((m == 0).sum())), torch.roll(m, -int((m == 0).sum())))
        for i, m in zip(ids, mask)
    ]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@pytest.mark.parametrize("mode", ["full", "none"])
def test_right_padded_prompts_decode_like_hf_on_the_left_padded_equivalent(mode):
    """HF warns on right padding and decodes the pad position's logits; generate shifts
    each right-padded row to its left-padded equivalent, so the continuation is HF's on
    the left-padded prompts (and the rows come back left-padded)."""
    model = F.model("llama", seed=2)
    g = graphed(model, mode=mode)
    left, lmask = F.prompts(3, seed=4)
    right, rmask = _right_padded(left, lmask)
    assert (rmask[:, -1] == 0).any() and not torch.equal(right, left)
    want = hf_generate(model, left, lmask)
    got = g.generate(right, rmask, max_new_tokens=NEW)
    assert torch.equal(got[:, left.shape[1] :], want[:, left.shape[1] :])
    assert torch.equal(got, want)
    # Padding on both sides of a row: the trailing part is moved to the front.
    both, bmask = right.clone(), rmask.clone()
    both[0], bmask[0] = torch.roll(left[1], -1), torch.roll(lmask[1], -1)  # 1 trailing pad
    assert bmask[0, 0] == 0 and bmask[0, -1] == 0
    got = g.generate(both, bmask, max_new_tokens=NEW)
    assert torch.equal(got[0], want[1])


def test_float_and_bool_input_ids_are_refused():
    """Float ids were truncated ([5.9, 7.2] ran as [5, 7]): now a ConfigError naming the dtype."""
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2, seed=3)
    for bad in (ids.float() + 0.9, ids.bool()):
        with pytest.raises(
            ConfigError, match=rf"input_ids must hold integer token ids.*{bad.dtype}"
        ):
            g.generate(bad, mask, max_new_tokens=NEW)
    assert torch.equal(
        g.generate(ids.int(), mask, max_new_tokens=NEW), hf_generate(model, ids, mask)
    )


def test_out_of_range_ids_are_refused_by_position_before_any_device_op():
    """An id >= vocab or < 0 would be a device-side assert on a GPU (the CUDA context
    poisoned): refused naming the position and value, before the embedding runs."""
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2, seed=3)
    for pos, value in (((1, 4), 150), ((0, 6), -1), ((1, 0), 101)):
        bad = ids.clone()
        bad[pos] = value
        with _OpLog() as log:
            with pytest.raises(
                ConfigError, match=rf"input_ids\[{pos[0]}, {pos[1]}\] = {value} .*vocabulary 101"
            ):
                g.generate(bad, mask, max_new_tokens=NEW)
        assert not [op for op in log.ops if "embedding" in op or "index_select" in op], log.ops
    for kw, needle in (
        ({"pad_token_id": 101}, "pad_token_id=101"),
        ({"eos_token_id": [2, -3]}, r"eos_token_id=\[2, -3\]"),
        ({"eos_token_id": "2"}, "eos_token_id must be an int or a list of ints"),
    ):
        with pytest.raises(ConfigError, match=needle):
            g.generate(ids, mask, max_new_tokens=NEW, **kw)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


def test_attention_mask_shape_values_and_empty_rows_are_checked():
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(3, seed=3)
    two = mask.clone()
    two[2, 5] = 2
    empty = mask.clone()
    empty[1] = 0
    for bad, needle in (
        (mask[:, :3], r"shape of input_ids \(3, 7\).*got torch.Size\(\[3, 3\]\)"),
        (mask[0], "shape of input_ids"),
        (two, r"attention_mask\[2, 5\] = 2: the mask must be 0 \(padding\) or 1"),
        (mask.float() * 0.5, r"attention_mask\[0, 0\] = 0\.5"),
        (empty, r"row\(s\) \[1\] are all 0"),
    ):
        with pytest.raises(ConfigError, match=needle):
            g.generate(ids, bad, max_new_tokens=NEW)
    got = g.generate(ids, mask.bool(), max_new_tokens=NEW)  # bool masks are fine
    assert torch.equal(got, hf_generate(model, ids, mask))


def test_no_mask_infers_the_padding_from_pad_token_id_like_hf():
    model = F.model("qwen2", seed=3)
    g = graphed(model)
    ids, mask = F.prompts(3, seed=7)  # left-padded with pad id 0
    want = model.generate(ids, do_sample=False, max_new_tokens=NEW, cache_implementation="static")
    assert torch.equal(want, hf_generate(model, ids, mask))  # HF inferred the mask too
    assert torch.equal(g.generate(ids, max_new_tokens=NEW), want)


def test_training_mode_after_capture_is_refused_until_eval():
    """The graphs hold the eval-mode forward: generate, verify and recapture refuse a
    model (or any submodule) put back in training mode, naming it and model.eval()."""
    model = F.model("llama", seed=1)
    g = graphed(model)
    ids, mask = F.prompts(2, seed=2)
    want = hf_generate(model, ids, mask)
    model.train()
    with pytest.raises(UnsupportedModelError, match=r"generate: .*training mode.*model\.eval\(\)"):
        g.generate(ids, mask, max_new_tokens=NEW)
    with pytest.raises(UnsupportedModelError, match=r"verify: .*training mode"):
        g.verify()
    with pytest.raises(UnsupportedModelError, match=r"recapture: .*training mode"):
        g.recapture(reason="test")
    model.eval()
    model.model.layers[1].mlp.train()  # one submodule is enough
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp"):
        g.generate(ids, mask, max_new_tokens=NEW)
    model.eval()
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), want)


def test_unsupported_generate_arguments_are_refused_by_name():
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2, seed=3)
    for kw, needle in (
        ({"num_beams": 2}, r"num_beams=2 \(beam search\)"),
        ({"repetition_penalty": 1.2}, r"repetition_penalty=1\.2 \(a logits processor\)"),
        ({"min_new_tokens": 3}, r"min_new_tokens=3 \(a minimum length"),
        ({"num_beams": 2, "no_repeat_ngram_size": 3}, r"num_beams=2.*no_repeat_ngram_size=3"),
        ({"typical_p": 0.5}, r"typical_p=0\.5 \(a sampling warper\)"),
        ({"streamer": object()}, r"streamer= \(streaming\)"),
        ({"return_dict_in_generate": True}, r"return_dict_in_generate= \(a dict result"),
        ({"top_kk": 3}, r"unknown argument\(s\) 'top_kk' \(did you mean 'top_k'\?\)"),
        ({"generation_config": {"top_k": 1}}, "must be a transformers GenerationConfig"),
    ):
        with pytest.raises(ConfigError, match=needle):
            g.generate(ids, mask, max_new_tokens=NEW, **kw)
    # Neutral values of the same settings change nothing, as in HF.
    neutral = {"num_beams": 1, "repetition_penalty": 1.0, "use_cache": True, "streamer": None}
    got = g.generate(ids, mask, max_new_tokens=NEW, **neutral)
    assert torch.equal(got, hf_generate(model, ids, mask, **neutral))


def test_bad_setting_values_are_config_errors_naming_the_argument():
    model = F.model("llama")
    g = graphed(model)
    ids, mask = F.prompts(2, seed=3)
    for kw, needle in (
        (
            {"do_sample": True, "top_p": "0.9"},
            r"top_p must be a number in \[0, 1\].*'0\.9' \(str\)",
        ),
        ({"do_sample": True, "top_p": 1.5}, "top_p must be a number in"),
        ({"do_sample": True, "top_k": 2.5}, "top_k must be an int >= 0"),
        ({"do_sample": True, "top_k": True}, "top_k must be an int >= 0"),
        ({"do_sample": True, "min_p": -0.1}, "min_p must be a number in"),
        ({"do_sample": True, "temperature": "hot"}, "temperature must be a number > 0"),
        ({"do_sample": True, "temperature": 0.0}, r"temperature=0\.0 with do_sample=True"),
        ({"do_sample": "yes"}, "do_sample must be a bool, got 'yes'"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"generator": "seed"}, "generator must be a torch.Generator on cpu"),
    ):
        with pytest.raises(ConfigError, match=needle):
            g.generate(ids, mask, **{"max_new_tokens": NEW, **kw})
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))


def _sampled(fn, seed=123, **kw):
    torch.manual_seed(seed)
    return fn(do_sample=True, **kw)


def test_sampling_settings_resolve_like_hf_none_turns_a_warper_off():
    """Not passed: the generation config's value, else HF's default (top_k=50 applies);
    passed as None: that warper off (HF's semantics). Each equals HF's seeded sampling."""
    model = F.model("llama", seed=4)
    g = graphed(model)
    ids, mask = F.prompts(3, seed=6)

    def ours(**kw):
        return g.generate(ids, mask, max_new_tokens=NEW, **kw)

    def hf(**kw):
        return hf_generate(model, ids, mask, **kw)

    for kw in ({}, {"top_k": None}, {"temperature": None, "top_p": None}, {"min_p": 0.2}):
        assert torch.equal(_sampled(ours, **kw), _sampled(hf, **kw)), kw
    # The default top-k of 50 is really applied (vocabulary 101): without it tokens differ.
    assert not torch.equal(_sampled(ours), _sampled(ours, top_k=None))


def test_generation_config_sampling_settings_are_applied():
    """top_k=1 / min_p=0.999 in model.generation_config were ignored when sampling: now
    applied as HF applies them; do_sample/temperature there too, and generation_config=."""
    import transformers as tf

    model = F.model("llama", seed=5)
    g = graphed(model)
    ids, mask = F.prompts(3, seed=8)
    greedy = hf_generate(model, ids, mask)
    for field, value in (("top_k", 1), ("min_p", 0.999)):
        setattr(model.generation_config, field, value)
        got = _sampled(lambda **kw: g.generate(ids, mask, max_new_tokens=NEW, **kw))
        assert torch.equal(got, greedy), field  # one token survives: sampling is greedy
        setattr(model.generation_config, field, None)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.7
    torch.manual_seed(9)
    want = hf_generate(model, ids, mask, do_sample=True)
    torch.manual_seed(9)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), want)
    model.generation_config.do_sample = None
    model.generation_config.temperature = None
    cfg = tf.GenerationConfig(do_sample=True, top_k=1)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW, generation_config=cfg), greedy)
    bad = tf.GenerationConfig(repetition_penalty=1.5)
    with pytest.raises(ConfigError, match=r"generation_config= enables.*repetition_penalty=1\.5"):
        g.generate(ids, mask, max_new_tokens=NEW, generation_config=bad)


def test_max_new_tokens_and_max_length_come_from_the_generation_config():
    model = F.model("llama", seed=6)
    g = graphed(model)
    ids, mask = F.prompts(2, seed=1)  # prompt of 7

    def hf():  # no max_new_tokens: HF reads the generation config
        return model.generate(
            ids, attention_mask=mask, do_sample=False, cache_implementation="static"
        )

    model.generation_config.max_new_tokens = 4
    got = g.generate(ids, mask)
    assert got.shape[1] == 11 and torch.equal(got, hf())
    model.generation_config.max_new_tokens = None
    model.generation_config.max_length = 10
    got = g.generate(ids, mask)
    assert got.shape[1] == 10 and torch.equal(got, hf())
    model.generation_config.max_length = 7
    with pytest.raises(ConfigError, match=r"max_length=7 .*no new token after a prompt of 7"):
        g.generate(ids, mask)
    model.generation_config.max_length = None
    got = g.generate(ids, mask, max_length=9)  # HF's keyword too: 2 new tokens
    assert got.shape[1] == 9 and torch.equal(
        got, hf_generate(model, ids, mask, max_length=9, max_new_tokens=None)
    )
    got = g.generate(ids, mask)  # nothing set anywhere: 20 new tokens, as HF's default
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):
        want = hf()  # HF says it fell back on its default
    assert got.shape[1] == 7 + 20 and torch.equal(got, want)


def test_generation_config_settings_not_applied_are_refused_before_capture():
    """repetition_penalty (and the like) in the model's own generation_config passed
    supported() and capture(), then failed at generate: now refused up front."""
    for field, value, needle in (
        ("repetition_penalty", 1.3, r"repetition_penalty=1\.3"),
        ("num_beams", 4, r"num_beams=4 \(beam search\)"),
        ("typical_p", 0.9, r"typical_p=0\.9"),
        ("no_repeat_ngram_size", 2, "no_repeat_ngram_size=2"),
    ):
        model = F.model("llama")
        setattr(model.generation_config, field, value)
        ok, reason = GraphedCausalLM.supported(model, max_cache_len=CACHE)
        assert not ok and re.search(needle, reason), reason
        with pytest.raises(UnsupportedModelError, match=needle):
            GraphedCausalLM(model, max_batch=2, max_cache_len=CACHE, mode="none", progress=False)
    model = F.model("llama")
    model.generation_config.repetition_penalty = 1.0  # neutral: accepted
    assert GraphedCausalLM.supported(model, max_cache_len=CACHE).ok


def test_model_split_across_devices_is_refused_naming_the_devices():
    """A split model failed inside capture with a raw cross-device error; now refused
    before anything is built, naming each device and a tensor on it."""
    model = F.model("llama")
    model.model.layers[1].to("meta")  # a second device the CPU has
    ok, reason = GraphedCausalLM.supported(model)
    assert not ok
    assert "several devices (cpu: model.embed_tokens.weight; meta: model.layers.1." in reason
    assert "meta device" in reason
    with pytest.raises(UnsupportedModelError, match="several devices"):
        GraphedCausalLM(model, max_batch=2, max_cache_len=CACHE, progress=False)


def test_verify_view_uses_the_documented_lm_interface():
    """VerifyView reads eager_step / cache_state / vocab_size, no private attributes."""
    import inspect as _inspect

    from graphguard.integrations import _hf_verify

    source = _inspect.getsource(_hf_verify)
    assert not re.findall(r"lm\._\w+", source)
    model = F.model("llama", seed=2)
    g = graphed(model)
    assert g.vocab_size == 101 and isinstance(g.cache_state, gg.state.StateSet)
    assert g.runner.state is not None and g.runner.state.names == g.cache_state.names


# ----------------------------------------------------------------- options=


def test_options_object_serves_the_decode_runner_and_keywords_beside_it_win():
    """GraphedCausalLM(options=CaptureOptions(...)) as for the runners: keywords beside it
    win; share_outputs/sanitize are forwarded keywords; what it sets itself is refused."""
    model = F.model("llama", seed=4)
    opts = gg.CaptureOptions(sizes=[1, 2], warmup_iters=2, name="opts.decode", lazy=True)
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=CACHE, backend=gg.RecordingBackend(),
        options=dataclasses.replace(opts, warmup_iters=1), progress=False, share_outputs=False,
    )  # fmt: skip
    r = g.runner
    assert r.sizes == (1, 2) and r.name == "opts.decode" and r.lazy
    assert r.options.warmup_iters == 1 and r.options.progress is False
    assert r.share_outputs is False and r.options.state is g.cache_state
    g.capture()
    ids, mask = F.prompts(2, seed=2)
    assert torch.equal(g.generate(ids, mask, max_new_tokens=NEW), hf_generate(model, ids, mask))
    assert g.captured_sizes == (2,)
    build = lambda **kw: GraphedCausalLM(model, max_batch=4, max_cache_len=CACHE, **kw)  # noqa: E731
    with pytest.raises(ConfigError, match="GraphedCausalLM sets state= itself"):
        build(options=gg.CaptureOptions(state=[]))
    with pytest.raises(ConfigError, match="GraphedCausalLM sets max_size= itself: pass max_batch="):
        build(options=gg.CaptureOptions(max_size=4))
    with pytest.raises(ConfigError, match="warmup_iters must be an int >= 1, got 0"):
        build(options=gg.CaptureOptions(warmup_iters=0))
    with pytest.raises(ConfigError, match="capture size 8 > max_batch 4"):
        build(sizes=[1, 8])
    moved = r"'warmup_iter' \(did you mean options=graphguard\.CaptureOptions\(warmup_iters="
    with pytest.raises(ConfigError, match=moved):
        build(warmup_iter=1)
    with pytest.raises(ConfigError, match=r"options must be a graphguard\.CaptureOptions"):
        build(options={"sizes": [1]})
