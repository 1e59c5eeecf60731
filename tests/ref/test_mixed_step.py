"""The reference model's mixed prefill+decode step, on CPU in float32 with the tiny preset.

``mixed_step`` is checked against the plain per-sequence, per-head reference loop of
``tests/ref/test_models.py`` (one token at a time, float64) over batches that mix prefill
chunks, decodes and speculative verifies with rejected drafts, with padded tokens
appended; plus its custom attention op, the PIECEWISE split of its traced graph, and
the padding contract.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from graphguard.piecewise import PiecewiseCompiler
from graphguard_ref.llama import (
    MIXED_ATTENTION_OP,
    LlamaConfig,
    LlamaDecodeModel,
    RopeScaling,
    causal_decode_mask,
    mixed_attention,
)
from tests.ref.test_models import ReferenceLlama, cache_snapshot, hf_weights, loaded_model

TINY = LlamaConfig.preset("tiny")
LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=128
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["rope-default", "rope-llama3"])
def test_mixed_step_matches_reference_over_prefill_chunks_decodes_and_verifies(
    scaling: RopeScaling | None,
) -> None:
    cfg = LlamaConfig.preset("tiny", rope_scaling=scaling, max_context=48)
    weights = hf_weights(cfg, seed=11)
    model = loaded_model(cfg, weights)
    ref = ReferenceLlama(cfg, weights)
    rng = random.Random(12)
    fill = model.pad_fill_values()
    # slot -> prompt; requests join at different steps
    prompts = {
        s: [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(3, 11))] for s in range(4)
    }
    joins = {0: 0, 1: 0, 2: 2, 3: 5}
    pos = dict.fromkeys(prompts, 0)
    kinds_seen: set[str] = set()
    for step in range(12):
        live = [s for s, start in joins.items() if start <= step]
        rng.shuffle(live)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        runs: list[tuple[int, int, int, str]] = []  # slot, first row, rows, kind
        for s in live:
            if pos[s] < len(prompts[s]):
                n = min(rng.randint(1, 5), len(prompts[s]) - pos[s])
                toks, kind = prompts[s][pos[s] : pos[s] + n], "prefill"
            else:
                n = 1 if rng.random() < 0.4 else 1 + rng.randint(1, 3)
                toks = [rng.randrange(cfg.vocab_size) for _ in range(n)]
                kind = "decode" if n == 1 else "verify"
            kinds_seen.add(kind)
            runs.append((s, len(tokens), n, kind))
            tokens += toks
            positions += range(pos[s], pos[s] + n)
            slots += [s] * n
        n_pad = rng.randint(0, 3)
        tokens += [fill[0]] * n_pad
        positions += [fill[1]] * n_pad
        slots += [fill[2]] * n_pad
        logits = model.mixed_step(
            torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots)
        )
        assert logits.shape == (len(tokens), cfg.vocab_size)
        assert torch.isfinite(logits).all()
        for s, first, n, kind in runs:
            for i in range(n):
                expected = ref.step(s, tokens[first + i])
                torch.testing.assert_close(
                    logits[first + i].double(),
                    expected,
                    atol=2e-4,
                    rtol=1e-4,
                    msg=f"step {step} slot {s} {kind} row {i}",
                )
            keep = n
            if kind == "verify":  # reject a random tail of the drafts: roll back
                keep = 1 + rng.randint(0, n - 1)
                for layer in ref.cache[s]:
                    del layer[pos[s] + keep :]
            pos[s] += keep
    assert kinds_seen == {"prefill", "decode", "verify"}


def test_one_token_per_row_equals_decode_step_with_rows_as_slots_and_padding() -> None:
    weights = hf_weights(TINY, seed=13)
    a = loaded_model(TINY, weights)
    b = loaded_model(TINY, weights)
    g = torch.Generator().manual_seed(14)
    fill = a.pad_fill_values()
    lengths = [0] * TINY.max_batch
    for _ in range(8):
        # decode_step's rows are slots: live row b is slot b; the rest are padding.
        batch = int(torch.randint(1, TINY.max_batch + 1, (1,), generator=g))
        live = torch.rand(batch, generator=g) < 0.75
        tok = torch.randint(0, TINY.vocab_size, (batch,), generator=g)
        pos = torch.tensor([lengths[r] for r in range(batch)])
        slots = torch.arange(batch)
        tok[~live], pos[~live], slots[~live] = fill
        mixed, decode = a.mixed_step(tok, pos, slots), b.decode_step(tok, pos, slots)
        torch.testing.assert_close(mixed[live], decode[live], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(mixed).all() and torch.isfinite(decode).all()
        for r in live.nonzero().flatten().tolist():
            lengths[r] += 1
    assert min(lengths) >= 1
    for x, y in zip(cache_snapshot(a), cache_snapshot(b)):
        torch.testing.assert_close(x[: TINY.max_batch], y[: TINY.max_batch], atol=1e-6, rtol=1e-5)


def test_padded_tokens_write_only_the_scratch_slot_and_do_not_change_live_rows() -> None:
    model = LlamaDecodeModel.random(TINY, seed=15)
    g = torch.Generator().manual_seed(16)
    # A 6-token prefill into slot 1 and a 3-token one into slot 2.
    model.mixed_step(
        torch.randint(0, TINY.vocab_size, (9,), generator=g),
        torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2]),
        torch.tensor([1] * 6 + [2] * 3),
    )
    before = cache_snapshot(model)
    tok, pos, slot = model.pad_fill_values()
    model.mixed_step(torch.full((7,), tok), torch.full((7,), pos), torch.full((7,), slot))
    for b, a in zip(before, cache_snapshot(model)):
        torch.testing.assert_close(a[: TINY.max_batch], b[: TINY.max_batch], rtol=0, atol=0)
        assert not torch.equal(a[TINY.scratch_slot], b[TINY.scratch_slot])
    # A verify run of 3 tokens for slot 1 at positions 6..8: alone, and with padding.
    live = (torch.tensor([7, 8, 9]), torch.tensor([6, 7, 8]), torch.tensor([1, 1, 1]))
    alone = model.mixed_step(*live)
    padded = model.mixed_step(
        torch.cat([live[0], torch.full((5,), tok)]),
        torch.cat([live[1], torch.full((5,), pos)]),
        torch.cat([live[2], torch.full((5,), slot)]),
    )
    torch.testing.assert_close(padded[:3], alone, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(padded).all()


def test_request_order_in_the_batch_does_not_matter() -> None:
    weights = hf_weights(TINY, seed=17)
    a, b = loaded_model(TINY, weights), loaded_model(TINY, weights)
    # prefill 4 tokens for slot 0, a decode for slot 3 at 0, a 2-token chunk for slot 2
    tok = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    pos = torch.tensor([0, 1, 2, 3, 0, 0, 1])
    slot = torch.tensor([0, 0, 0, 0, 3, 2, 2])
    perm = torch.tensor([5, 6, 4, 0, 1, 2, 3])
    out_a = a.mixed_step(tok, pos, slot)
    out_b = b.mixed_step(tok[perm], pos[perm], slot[perm])
    torch.testing.assert_close(out_b, out_a[perm], atol=1e-6, rtol=1e-5)


def test_later_tokens_of_a_chunk_see_earlier_ones_but_not_the_reverse() -> None:
    model = LlamaDecodeModel.random(TINY, seed=18)
    base = model.mixed_step(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2]), torch.tensor([0] * 3))
    model.reset_cache()
    changed = model.mixed_step(
        torch.tensor([3, 4, 99]), torch.tensor([0, 1, 2]), torch.tensor([0] * 3)
    )
    torch.testing.assert_close(changed[:2], base[:2], atol=0, rtol=0)
    assert not torch.allclose(changed[2], base[2])
    model.reset_cache()
    first = model.mixed_step(
        torch.tensor([77, 4, 5]), torch.tensor([0, 1, 2]), torch.tensor([0] * 3)
    )
    assert not torch.allclose(first[1], base[1])  # token 1 attends to token 0


# --------------------------------------------------------------------------- the custom op


def _mixed_args() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(19)
    q = torch.randn(5, 4, 16, generator=g)
    k = torch.randn(5, 2, 16, generator=g)
    v = torch.randn(5, 2, 16, generator=g)
    k_cache = torch.randn(4, 2, 32, 16, generator=g)  # [slots, kv_heads, context, head_dim]
    v_cache = torch.randn(4, 2, 32, 16, generator=g)
    slots = torch.tensor([0, 0, 0, 2, 3])
    positions = torch.tensor([4, 5, 6, 9, 0])
    mask = causal_decode_mask(positions, 32, torch.float32)
    return q, k, v, k_cache, v_cache, slots, positions, mask


def test_mixed_attention_is_a_registered_mutating_custom_op_that_passes_opcheck() -> None:
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch>=2.4")
    assert MIXED_ATTENTION_OP == "graphguard_ref::mixed_attention"
    op = torch.ops.graphguard_ref.mixed_attention.default
    schema = str(op._schema)
    assert "Tensor(a!) k_cache" in schema and "Tensor(b!) v_cache" in schema
    opcheck(op, _mixed_args())


def test_mixed_attention_writes_the_step_kv_then_attends_to_each_tokens_prefix() -> None:
    q, k, v, k_cache, v_cache, slots, positions, mask = _mixed_args()
    kc, vc = k_cache.clone(), v_cache.clone()
    out = mixed_attention(q, k, v, kc, vc, slots, positions, mask)
    torch.testing.assert_close(kc[slots, :, positions], k)
    torch.testing.assert_close(vc[slots, :, positions], v)
    untouched = torch.ones(4, 32, dtype=torch.bool)
    untouched[slots, positions] = False
    assert torch.equal(kc.transpose(1, 2)[untouched], k_cache.transpose(1, 2)[untouched])
    # Every token by hand: softmax over its slot's positions 0..p, GQA group of 2 (token
    # 3 is slot 2, token 4 slot 3: tokens are not rows of the cache here).
    for t, (slot, p) in enumerate(zip(slots.tolist(), positions.tolist())):
        keys, values = kc[slot, :, : p + 1], vc[slot, :, : p + 1]  # [kvh, p + 1, hd]
        for head in range(4):
            kvh = head // 2
            scores = keys[kvh] @ q[t, head] / 4.0
            expected = torch.softmax(scores, 0) @ values[kvh]
            torch.testing.assert_close(out[t, head], expected, atol=1e-5, rtol=1e-5)


def test_mixed_attention_fake_kernel_gives_shape_without_computing() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) for a in _mixed_args()]
        out = mixed_attention(*args)
    assert out.shape == (5, 4, 16) and out.dtype == torch.float32


# --------------------------------------------------------------------------- the split


@pytest.mark.compile
def test_compiled_mixed_step_splits_at_every_layers_attention_with_one_compile() -> None:
    model = LlamaDecodeModel.random(TINY, seed=20)
    compiler = PiecewiseCompiler([MIXED_ATTENTION_OP])
    compiled = torch.compile(model.mixed_step, backend=compiler, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for n in (5, 9, 3):
            tok = torch.randint(0, TINY.vocab_size, (n,), generator=g)
            pos = torch.arange(n) + 2
            slot = torch.tensor([0, 1, 2] * 3)[:n]
            expected = model.mixed_step(tok, pos, slot)
            torch.testing.assert_close(compiled(tok, pos, slot), expected, atol=1e-6, rtol=1e-5)
    assert compiler.compile_count == 1
    gm = compiler.graphs[0]
    split_nodes = [n for n in gm.graph.nodes if compiler.matcher(n)]
    assert len(split_nodes) == TINY.num_layers
    assert len(compiler.pieces) == TINY.num_layers + 1
    for piece in compiler.pieces:
        assert not any(compiler.matcher(n) for n in piece.module.graph.nodes)
    # The projections, norms, MLP and head are in the pieces, not in the split ops.
    targets = {str(n.target) for p in compiler.pieces for n in p.module.graph.nodes}
    assert any("linear" in t for t in targets) and any("addmm" in t for t in targets)
