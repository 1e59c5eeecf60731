"""The reference Llama decode model, on CPU in float32 with the ``tiny`` preset.

The model's fused, batched, graph-friendly decode step is checked against a plain
per-sequence, per-head loop written here from the Llama definition (explicit softmax,
complex-multiply RoPE, repeated KV heads), on weights the test makes under Hugging Face
names — so the loader's name mapping is checked too, not assumed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard import phase
from graphguard.errors import ConfigError
from graphguard.streams import AuxStream
from graphguard_ref.llama import (
    PRESETS,
    LlamaConfig,
    LlamaDecodeModel,
    RopeScaling,
    attention,
    causal_decode_mask,
)

TINY = LlamaConfig.preset("tiny")
LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=128
)


# --------------------------------------------------------------------------- reference


def hf_weights(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, made independently of the model."""
    g = torch.Generator().manual_seed(seed)
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.1

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, d), "model.norm.weight": norm()}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = mat(cfg.num_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, cfg.num_heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(i, d)
        w[p + "mlp.up_proj.weight"] = mat(i, d)
        w[p + "mlp.down_proj.weight"] = mat(d, i)
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = mat(cfg.vocab_size, d)
    return w


def reference_inv_freq(cfg: LlamaConfig) -> list[float]:
    """Per-frequency RoPE inverse frequencies, Llama-3 scaling written out branch by branch."""
    out = []
    for j in range(cfg.head_dim // 2):
        f = cfg.rope_theta ** (-2 * j / cfg.head_dim)
        s = cfg.rope_scaling
        if s is not None:
            wavelen = 2 * math.pi / f
            if wavelen < s.original_max_position / s.high_freq_factor:
                pass
            elif wavelen > s.original_max_position / s.low_freq_factor:
                f = f / s.factor
            else:
                smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                f = (1 - smooth) * f / s.factor + smooth * f
        out.append(f)
    return out


class ReferenceLlama:
    """One token at a time, one sequence at a time, one head at a time, in float64."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = {k: v.double() for k, v in weights.items()}
        self.inv_freq = torch.tensor(reference_inv_freq(cfg), dtype=torch.float64)
        # cache[seq][layer] = list of (k [kvh, hd], v [kvh, hd]) per position
        self.cache: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean() + self.cfg.rms_norm_eps) * weight

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half], x[..., half:])
        z = z * torch.polar(torch.ones_like(self.inv_freq), pos * self.inv_freq)
        return torch.cat((z.real, z.imag), dim=-1)

    def step(self, seq: int, token: int) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        layers = self.cache.setdefault(seq, [[] for _ in range(cfg.num_layers)])
        pos = len(layers[0])
        h = w["model.embed_tokens.weight"][token]
        group = cfg.num_heads // cfg.num_kv_heads
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}."
            x = self._rms(h, w[p + "input_layernorm.weight"])
            q = (w[p + "self_attn.q_proj.weight"] @ x).view(cfg.num_heads, cfg.head_dim)
            k = (w[p + "self_attn.k_proj.weight"] @ x).view(cfg.num_kv_heads, cfg.head_dim)
            v = (w[p + "self_attn.v_proj.weight"] @ x).view(cfg.num_kv_heads, cfg.head_dim)
            layers[n].append((self._rope(k, pos), v))
            keys = torch.stack([kk for kk, _ in layers[n]]).repeat_interleave(group, dim=1)
            values = torch.stack([vv for _, vv in layers[n]]).repeat_interleave(group, dim=1)
            q = self._rope(q, pos)
            heads = []
            for head in range(cfg.num_heads):
                scores = keys[:, head] @ q[head] / math.sqrt(cfg.head_dim)  # [pos + 1]
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                heads.append(probs @ values[:, head])
            h = h + w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            x = self._rms(h, w[p + "post_attention_layernorm.weight"])
            gate = w[p + "mlp.gate_proj.weight"] @ x
            up = w[p + "mlp.up_proj.weight"] @ x
            h = h + w[p + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)
        head_w = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return head_w @ self._rms(h, w["model.norm.weight"])


def loaded_model(cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> LlamaDecodeModel:
    model = LlamaDecodeModel(cfg, device="cpu", dtype=torch.float32, seed=None)
    model.load_hf_weights(weights)
    return model


def cache_snapshot(model: LlamaDecodeModel) -> list[torch.Tensor]:
    out = []
    for layer in model.layers:
        out += [layer.k_cache.clone(), layer.v_cache.clone()]  # type: ignore[operator]
    return out


def cache_restore(model: LlamaDecodeModel, snapshot: list[torch.Tensor]) -> None:
    caches = [c for layer in model.layers for c in (layer.k_cache, layer.v_cache)]
    for cache, saved in zip(caches, snapshot, strict=True):
        cache.copy_(saved)  # type: ignore[operator]


def gather_decode_reference(
    model: LlamaDecodeModel, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The pre-"rows are slots" decode step, written out: per row, gather its slot's cache.

    Plain torch, one row and one head at a time, on the model's own weights and caches
    (written like the model writes them), so the gather-free step is checked against the
    straightforward computation on the same state.
    """
    cfg = model.config
    h = model.embed_tokens[tokens]
    cos = model.rope_cos[positions].unsqueeze(1)
    sin = model.rope_sin[positions].unsqueeze(1)
    group = cfg.num_heads // cfg.num_kv_heads
    for layer in model.layers:
        x = torch.nn.functional.rms_norm(h, (cfg.hidden_size,), layer.input_norm, cfg.rms_norm_eps)
        qkv = x @ layer.qkv_weight.t()  # type: ignore[operator]
        q = qkv[:, : cfg.q_size].reshape(-1, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].reshape(
            -1, cfg.num_kv_heads, cfg.head_dim
        )
        v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        half = cfg.head_dim // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
        for b in range(len(tokens)):
            layer.k_cache[slots[b], :, positions[b]] = k[b]  # type: ignore[index]
            layer.v_cache[slots[b], :, positions[b]] = v[b]  # type: ignore[index]
        rows = []
        for b in range(len(tokens)):
            keys = layer.k_cache[slots[b], :, : positions[b] + 1]  # type: ignore[index]
            values = layer.v_cache[slots[b], :, : positions[b] + 1]  # type: ignore[index]
            heads = []
            for head in range(cfg.num_heads):
                scores = keys[head // group] @ q[b, head] / math.sqrt(cfg.head_dim)
                heads.append(torch.softmax(scores, 0) @ values[head // group])
            rows.append(torch.cat(heads))
        h = h + torch.stack(rows) @ layer.o_weight.t()  # type: ignore[operator]
        x = torch.nn.functional.rms_norm(h, (cfg.hidden_size,), layer.post_norm, cfg.rms_norm_eps)
        gate, up = (x @ layer.gate_up_weight.t()).chunk(2, -1)  # type: ignore[operator]
        h = h + (torch.nn.functional.silu(gate) * up) @ layer.down_weight.t()  # type: ignore[operator]
    x = torch.nn.functional.rms_norm(h, (cfg.hidden_size,), model.norm, cfg.rms_norm_eps)
    return x @ model.lm_head.t()


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["rope-default", "rope-llama3"])
def test_decode_step_matches_per_sequence_reference_loops(scaling: RopeScaling | None) -> None:
    cfg = LlamaConfig.preset("tiny", rope_scaling=scaling, max_context=32)
    weights = hf_weights(cfg, seed=1)
    model = loaded_model(cfg, weights)
    ref = ReferenceLlama(cfg, weights)
    g = torch.Generator().manual_seed(2)
    # Rows are slots. Sequences join (and slot 0 leaves) at different steps, so live
    # rows sit at different positions and the batch has holes: a hole is a padded row,
    # and padded rows also fill the batch up to a random size above the last live slot.
    joins = {0: 0, 2: 3, 1: 5, 3: 9}  # slot -> step it starts at
    leaves = {0: 11}  # slot -> step it is gone (its cache stays: padding must not touch it)
    lengths = dict.fromkeys(joins, 0)
    fill = model.pad_fill_values()
    for step in range(14):
        live = {s for s, start in joins.items() if start <= step < leaves.get(s, 99)}
        batch = int(torch.randint(max(live) + 1, cfg.max_batch + 1, (1,), generator=g))
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g).tolist()
        rows_tok = [t if b in live else fill[0] for b, t in enumerate(tokens)]
        rows_pos = [lengths[b] if b in live else fill[1] for b in range(batch)]
        rows_slot = [b if b in live else fill[2] for b in range(batch)]
        logits = model.decode_step(
            torch.tensor(rows_tok), torch.tensor(rows_pos), torch.tensor(rows_slot)
        )
        assert logits.shape == (batch, cfg.vocab_size)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        for slot in sorted(live):
            expected = ref.step(slot, tokens[slot])
            torch.testing.assert_close(
                logits[slot].double(),
                expected,
                atol=2e-4,
                rtol=1e-4,
                msg=f"step {step} slot {slot}",
            )
            lengths[slot] += 1
    assert lengths == {0: 11, 1: 9, 2: 11, 3: 5}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_step_equals_the_per_row_gather_computation_with_padded_rows(seed: int) -> None:
    cfg = LlamaConfig.preset("tiny", max_batch=6, max_context=24)
    a = LlamaDecodeModel.random(cfg, seed=30 + seed)
    b = LlamaDecodeModel.random(cfg, seed=30 + seed)
    g = torch.Generator().manual_seed(seed)
    for step in range(6):
        batch = int(torch.randint(1, cfg.max_batch + 1, (1,), generator=g))
        live = torch.rand(batch, generator=g) < 0.7
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        positions = torch.randint(0, cfg.max_context, (batch,), generator=g)
        slots = torch.arange(batch)
        tok, pos, slot = a.pad_fill_values()
        tokens[~live], positions[~live], slots[~live] = tok, pos, slot
        got = a.decode_step(tokens, positions, slots)
        want = gather_decode_reference(b, tokens, positions, slots)
        torch.testing.assert_close(got[live], want[live], atol=1e-5, rtol=1e-5, msg=f"step {step}")
        for x, y in zip(cache_snapshot(a), cache_snapshot(b)):
            torch.testing.assert_close(x[: cfg.max_batch], y[: cfg.max_batch], atol=1e-6, rtol=1e-5)


def test_overlap_flag_does_not_change_logits() -> None:
    weights = hf_weights(TINY, seed=3)
    a = loaded_model(TINY, weights)
    b = LlamaDecodeModel(TINY, seed=None, overlap=False)
    b.load_hf_weights(weights)
    inputs = a.example_inputs(3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a.decode_step(*inputs), b.decode_step(*inputs))


def test_padded_rows_on_scratch_slot_leave_live_caches_and_logits_unchanged() -> None:
    model = LlamaDecodeModel.random(TINY, seed=4)
    g = torch.Generator().manual_seed(5)
    # Give every live slot some history first.
    for pos in range(4):
        model.decode_step(
            torch.randint(0, TINY.vocab_size, (TINY.max_batch,), generator=g),
            torch.full((TINY.max_batch,), pos),
            torch.arange(TINY.max_batch),
        )
    before = cache_snapshot(model)
    tok, pos, slot = model.pad_fill_values()
    n_pad = TINY.max_batch
    model.decode_step(
        torch.full((n_pad,), tok), torch.full((n_pad,), pos), torch.full((n_pad,), slot)
    )
    after = cache_snapshot(model)
    for b, a in zip(before, after):
        torch.testing.assert_close(a[: TINY.max_batch], b[: TINY.max_batch], rtol=0, atol=0)
        assert not torch.equal(a[TINY.scratch_slot], b[TINY.scratch_slot])
    # Live rows 0 and 2 with a padded hole at row 1 and a padded tail at row 3: their
    # logits equal the batch without the tail, whatever the holes' slots hold.
    state = cache_snapshot(model)
    live = (torch.tensor([7, tok, 9, tok]), torch.tensor([4, pos, 4, pos]))
    padded = model.decode_step(*live, torch.tensor([0, slot, 2, slot]))
    assert torch.isfinite(padded).all()
    cache_restore(model, state)
    shorter = model.decode_step(live[0][:3], live[1][:3], torch.tensor([0, slot, 2]))
    torch.testing.assert_close(padded[:3], shorter, atol=1e-6, rtol=1e-5)  # GEMM blocking
    cache_restore(model, state)
    for layer in model.layers:  # the padded rows' slots: anything at all
        layer.k_cache[1].normal_(0, 10)  # type: ignore[index]
        layer.v_cache[3].normal_(0, 10)  # type: ignore[index]
    again = model.decode_step(*live, torch.tensor([0, slot, 2, slot]))
    torch.testing.assert_close(again[[0, 2]], padded[[0, 2]], rtol=0, atol=0)
    assert torch.isfinite(again).all()


def test_decode_step_refuses_more_rows_than_slots() -> None:
    model = LlamaDecodeModel.random(TINY, seed=4)
    n = TINY.max_batch + 1
    zeros = torch.zeros(n, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"max_batch=4 slots and decode rows are slots"):
        model.decode_step(zeros, zeros, torch.full((n,), TINY.scratch_slot))


# --------------------------------------------------------------------------- the custom op


def _attention_args(mask: bool) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 4, 16, generator=g)
    k = torch.randn(5, 2, 32, 16, generator=g)  # [slots, kv_heads, context, head_dim]
    v = torch.randn(5, 2, 32, 16, generator=g)
    positions = torch.tensor([0, 9, 31])
    m = causal_decode_mask(positions, 32, torch.float32) if mask else None
    return q, k, v, positions, m


@pytest.mark.parametrize("with_mask", [False, True], ids=["mask-built-inside", "mask-passed"])
def test_attention_custom_op_passes_opcheck(with_mask: bool) -> None:
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch>=2.4")
    op = torch.ops.graphguard_ref.decode_attention.default
    opcheck(op, _attention_args(with_mask))


def test_attention_fake_kernel_gives_shape_without_computing() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v, positions, mask = (mode.from_tensor(a) for a in _attention_args(True))
        out = attention(q, k, v, positions, mask)
    assert out.shape == (3, 4, 16) and out.dtype == torch.float32


def test_attention_mask_passed_or_built_agree_and_rows_see_only_their_prefix() -> None:
    q, k, v, positions, mask = _attention_args(True)
    torch.testing.assert_close(attention(q, k, v, positions), attention(q, k, v, positions, mask))
    # Changing the cache after row 1's position (9) must not change row 1's output.
    k2 = k.clone()
    k2[1, :, 10:] += 100.0
    out1, out2 = attention(q, k, v, positions), attention(q, k2, v, positions)
    torch.testing.assert_close(out1[1], out2[1])
    k3 = k.clone()
    k3[2, :, 10:] += 100.0  # the same change in row 2's slot: row 2 sees 0..31
    assert not torch.allclose(attention(q, k3, v, positions)[2], out1[2])


def test_attention_rows_are_slots_and_equal_a_per_row_per_head_softmax() -> None:
    q, k, v, positions, _ = _attention_args(False)
    out = attention(q, k, v, positions)
    for row, p in enumerate(positions.tolist()):
        for head in range(4):
            kvh = head // 2
            scores = k[row, kvh, : p + 1] @ q[row, head] / 4.0  # row b reads slot b
            expected = torch.softmax(scores, 0) @ v[row, kvh, : p + 1]
            torch.testing.assert_close(out[row, head], expected, atol=1e-5, rtol=1e-5)
    # Slots past the batch (3, 4) are never read.
    k2, v2 = k.clone(), v.clone()
    k2[3:], v2[3:] = float("nan"), float("nan")
    torch.testing.assert_close(attention(q, k2, v2, positions), out, rtol=0, atol=0)


@pytest.mark.compile
def test_torch_compile_traces_decode_step_whole_with_attention_as_an_opaque_op() -> None:
    model = LlamaDecodeModel.random(TINY, seed=7)
    inputs = model.example_inputs(3, generator=torch.Generator().manual_seed(1))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    expected = model.decode_step(*inputs)  # eager first: sizes the arena (growth is host code)
    torch._dynamo.reset()
    compiled = torch.compile(model.decode_step, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), expected)
    ops = [n.target for n in graphs[0].graph.nodes if "decode_attention" in str(n.target)]
    assert len(ops) == TINY.num_layers


# --------------------------------------------------------------------------- loading


def write_checkpoint(
    directory: Path, cfg: LlamaConfig, weights: dict[str, torch.Tensor], shards: int = 2
) -> None:
    from safetensors.torch import save_file

    hf_cfg: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_cfg))
    names = sorted(weights)
    for s in range(shards):
        part = {n: weights[n].contiguous() for n in names[s::shards]}
        save_file(part, str(directory / f"model-{s:05d}-of-{shards:05d}.safetensors"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_pretrained_round_trips_a_sharded_safetensors_checkpoint(
    tmp_path: Path, tied: bool
) -> None:
    pytest.importorskip("safetensors")
    cfg = LlamaConfig.preset("tiny", tie_word_embeddings=tied)
    weights = hf_weights(cfg, seed=8)
    write_checkpoint(tmp_path, cfg, weights)
    model = LlamaDecodeModel.from_pretrained(tmp_path, max_batch=cfg.max_batch, max_context=64)
    assert model.config == cfg
    assert model.dtype == torch.float32
    assert (model.lm_head is model.embed_tokens) == tied
    views = model.hf_weight_views()
    assert sorted(views) == sorted(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(views[name], tensor, rtol=0, atol=0, msg=name)
    ref = ReferenceLlama(cfg, weights)
    logits = model.decode_step(torch.tensor([5]), torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(logits[0].double(), ref.step(0, 5), atol=2e-4, rtol=1e-4)


def test_from_pretrained_names_the_tensor_whose_shape_is_wrong(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    weights = hf_weights(TINY, seed=9)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, TINY.hidden_size)
    write_checkpoint(tmp_path, TINY, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(3, 64\)"):
        LlamaDecodeModel.from_pretrained(tmp_path, max_batch=4)


def test_load_hf_weights_lists_missing_and_unknown_tensors() -> None:
    weights = hf_weights(TINY, seed=10)
    model = LlamaDecodeModel(TINY, seed=None)
    missing = dict(weights)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\): model\.norm\.weight"):
        model.load_hf_weights(missing)
    extra = dict(weights, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match=r"does not know: model\.layers\.0\.self_attn\.q_proj"):
        model.load_hf_weights(extra)


def test_from_pretrained_without_safetensors_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install 'graphguard-ref\[hf\]'"):
        LlamaDecodeModel.from_pretrained(tmp_path)


def test_from_hf_config_of_llama_3_2_1b_equals_the_preset() -> None:
    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    assert LlamaConfig.from_hf_config(hf, max_batch=256) == LlamaConfig.preset("llama-1b")
    with pytest.raises(ValueError, match="biases"):
        LlamaConfig.from_hf_config({**hf, "attention_bias": True})


# --------------------------------------------------------------------------- config, weights


def test_presets_have_the_stated_shapes() -> None:
    tiny = LlamaConfig.preset("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    assert (tiny.intermediate_size, tiny.vocab_size, tiny.max_context) == (128, 256, 64)
    big = LlamaConfig.preset("llama-1b")
    assert (big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads) == (16, 2048, 32, 8)
    assert (big.head_dim, big.intermediate_size, big.vocab_size) == (64, 8192, 128256)
    assert (big.rope_theta, big.rms_norm_eps, big.tie_word_embeddings) == (500000.0, 1e-5, True)
    assert big.max_context == 1024 and big.scratch_slot == big.max_batch
    assert big.num_params == 1_235_814_400  # meta-llama/Llama-3.2-1B
    assert LlamaConfig.preset("llama-1b", max_batch=32).max_batch == 32
    assert set(PRESETS) == {"tiny", "llama-1b"}
    with pytest.raises(ValueError, match="unknown Llama preset"):
        LlamaConfig.preset("llama-70b")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig.preset("tiny", num_kv_heads=3)


def test_model_allocates_kv_cache_with_a_scratch_slot() -> None:
    model = LlamaDecodeModel.random(TINY)
    for layer in model.layers:
        assert layer.k_cache.shape == (TINY.max_batch + 1, 2, TINY.max_context, 16)
        assert layer.k_cache.is_contiguous()
        assert layer.v_cache.shape == layer.k_cache.shape
    n = sum(p.numel() for p in model.parameters())
    assert n == TINY.num_params


def test_random_weights_are_seeded_and_non_degenerate() -> None:
    a, b = LlamaDecodeModel.random(TINY, seed=11), LlamaDecodeModel.random(TINY, seed=11)
    c = LlamaDecodeModel.random(TINY, seed=12)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all() and pa.abs().sum() > 0, name
        if pa.dim() == 2:
            assert abs(pa.std().item() - 0.02) < 0.004, name
            assert not torch.equal(pa, pc), name
    logits = a.decode_step(*a.example_inputs(4, generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.05  # each row spreads over the vocabulary
    assert not torch.equal(logits[0], logits[1])  # rows differ, not a constant model


# --------------------------------------------------------------------------- engine helpers


def test_example_inputs_are_realistic_and_fill_values_target_the_scratch_slot() -> None:
    model = LlamaDecodeModel.random(TINY)
    tokens, positions, slots = model.example_inputs(4, generator=torch.Generator().manual_seed(0))
    assert tokens.dtype == positions.dtype == slots.dtype == torch.int64
    assert slots.tolist() == [0, 1, 2, 3]  # rows are slots
    assert int(positions.min()) >= 0 and int(positions.max()) < TINY.max_context
    assert model.pad_fill_values() == (0, 0, TINY.max_batch)
    with pytest.raises(ValueError, match="max_batch"):
        model.example_inputs(TINY.max_batch + 1)


def test_warm_kernels_touches_only_the_scratch_slot_and_sizes_the_arena() -> None:
    model = LlamaDecodeModel.random(TINY, seed=13)
    model.decode_step(*model.example_inputs(4, generator=torch.Generator().manual_seed(0)))
    before = cache_snapshot(model)
    with phase.enter(phase.Phase.WARMUP, owner="test"):
        model.warm_kernels([2, 1, 3])
    after = cache_snapshot(model)
    for b, a in zip(before, after):
        torch.testing.assert_close(a[: TINY.max_batch], b[: TINY.max_batch], rtol=0, atol=0)
        # positions spread across the whole context, including the last one
        assert not torch.equal(a[TINY.scratch_slot, :, -1], b[TINY.scratch_slot, :, -1])
    arena = model.workspace
    arena.lock()
    growths = arena.growths
    model.decode_step(*model.example_inputs(3))  # every size up to max_batch fits
    model.decode_step(
        torch.zeros(4, dtype=torch.long),
        torch.zeros(4, dtype=torch.long),
        torch.full((4,), TINY.scratch_slot),
    )
    assert arena.growths == growths


def test_warm_kernels_refuses_capture_sizes_above_max_batch_before_any_capture() -> None:
    model = LlamaDecodeModel.random(TINY, seed=13)
    with pytest.raises(ConfigError, match=r"capture size\(s\) \[8\] exceed max_batch=4"):
        model.warm_kernels([2, 8])
    with pytest.raises(ConfigError, match="positive"):
        model.warm_kernels([0])
    assert model.workspace.peak_bytes == 0  # refused before running anything


def test_workspace_scratch_scales_with_batch() -> None:
    # Per row: gate/up [2I] + activation [I] + mask [ctx], float32.
    row_bytes = (3 * TINY.intermediate_size + TINY.max_context) * 4
    model = LlamaDecodeModel.random(TINY)
    model.warm_kernels([1])  # also warms max_batch (4), the cache's capacity
    assert TINY.max_batch * row_bytes <= model.workspace.peak_bytes < 8 * row_bytes
    big = LlamaDecodeModel.random(LlamaConfig.preset("tiny", max_batch=64))
    big.warm_kernels([1])
    assert big.workspace.peak_bytes >= 64 * row_bytes


class _RecordingStreams:
    """A fake StreamBackend: real streams 'exist', every call is logged, work runs inline."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def available(self, device: torch.device) -> bool:
        return True

    def current_stream(self, device: torch.device) -> str:
        return "main"

    def new_stream(self, device: torch.device, priority: int) -> str:
        return "aux"

    def record_event(self, stream: Any) -> str:
        self.log.append(f"record:{stream}")
        return f"event:{stream}"

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(f"wait:{stream}<-{event}")

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        self.log.append(f"use:{stream}")
        return nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(f"record_stream:{stream}:{tuple(tensor.shape)}")


def _forks(log: list[str]) -> Iterator[str]:
    return (e for e in log if e == "use:aux")


def test_positional_branch_forks_to_the_aux_stream_except_during_warmup() -> None:
    model = LlamaDecodeModel.random(TINY)
    fake = _RecordingStreams()
    model.aux_stream = AuxStream("llama.rope_mask", "cpu", backend=fake)
    inputs = model.example_inputs(3, generator=torch.Generator().manual_seed(0))
    model.decode_step(*inputs)
    assert fake.log == [
        "record:main",
        "wait:aux<-event:main",
        "record_stream:aux:(3,)",  # positions
        f"record_stream:aux:(3, 1, 1, {TINY.max_context})",  # the arena's mask view
        "use:aux",
        "record_stream:main:(3, 1, 16)",  # cos kept for the main stream
        "record_stream:main:(3, 1, 16)",  # sin
        "use:main",  # embedding + first RMSNorm on the caller's stream, inside the fork
        "record:aux",
        "wait:main<-event:aux",
    ]
    fake.log.clear()
    with phase.enter(phase.Phase.WARMUP, owner="test"):
        model.warm_kernels([2])
    assert not list(_forks(fake.log))  # inline: nothing may outlive an uncaptured warmup
    fake.log.clear()
    LlamaDecodeModel.decode_step(model, *inputs)
    no_overlap = LlamaDecodeModel.random(TINY, overlap=False)
    no_overlap.aux_stream = AuxStream("x", "cpu", backend=(other := _RecordingStreams()))
    no_overlap.decode_step(*inputs)
    assert other.log == []


class _CacheReads(TorchDispatchMode):
    """Records the ops that take a KV cache's storage as their first argument."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {c.untyped_storage().data_ptr() for c in caches}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in self.storages:
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


GATHERS = {"index_select", "index", "gather", "take", "clone", "contiguous"}


def test_decode_attention_reads_the_cache_as_a_view_and_never_gathers_it() -> None:
    from graphguard_ref.llama import ops

    model = LlamaDecodeModel.random(TINY, seed=40)
    caches = [c for layer in model.layers for c in (layer.k_cache, layer.v_cache)]
    inputs = model.example_inputs(3, generator=torch.Generator().manual_seed(0))
    with _CacheReads(caches) as spy:
        model.decode_step(*inputs)
    assert spy.ops and "index_put_" in spy.ops and not GATHERS & set(spy.ops), spy.ops
    q, k, v, positions, mask = _attention_args(True)
    with _CacheReads([k, v]) as spy:
        ops._decode_attention_impl(q, k, v, positions, mask)
    assert "slice" in spy.ops and not GATHERS & set(spy.ops), spy.ops
    # The mixed step's tokens are not slots: it does gather (the check can see one).
    slots = torch.tensor([0, 0, 2])
    with _CacheReads([k, v]) as spy:
        ops._mixed_attention_impl(q, q[:, :2], q[:, :2], k, v, slots, positions, mask)
    assert "index_select" in spy.ops


def test_decode_sdpa_choice_is_validated_and_defaults_to_cudnn() -> None:
    assert LlamaConfig.preset("tiny").decode_sdpa == "cudnn"
    assert LlamaConfig.preset("tiny", decode_sdpa="planless").decode_sdpa == "planless"
    with pytest.raises(ConfigError, match="decode_sdpa must be 'cudnn' or 'planless'"):
        LlamaConfig.preset("tiny", decode_sdpa="flash")


def test_decode_sdpa_choice_changes_kernels_not_results_on_cpu() -> None:
    # On the CPU the cuDNN permission is moot: both choices are the same math, and the op's
    # schema carries the flag (opcheck'd above with its default).
    q, k, v, positions, mask = _attention_args(True)
    torch.testing.assert_close(
        attention(q, k, v, positions, mask, cudnn=True),
        attention(q, k, v, positions, mask, cudnn=False),
        rtol=0,
        atol=0,
    )
    outs = []
    for choice in ("cudnn", "planless"):
        cfg = LlamaConfig.preset("tiny", max_batch=4, max_context=32, decode_sdpa=choice)
        model = LlamaDecodeModel.random(cfg, seed=0, overlap=False)
        with torch.inference_mode():
            inputs = model.example_inputs(3, generator=torch.Generator().manual_seed(1))
            outs.append(model.decode_step(*inputs))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
