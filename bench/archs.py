"""Decode-step architectures beyond the reference model, for the pool bench and the tests.

Each model exposes the same small surface the benches need: ``step(*inputs)`` (one row
per sequence, graph-capturable: no host sync, no value-dependent shapes),
``example_inputs(batch)``, ``pad_fill_values()`` and ``max_batch``. Rows are
independent, so padded rows cannot change live rows.

- :class:`MoEBlock`: RMSNorm -> top-k routed experts on the main stream beside a shared
  expert on an auxiliary stream (``gg.AuxStream`` fork/join), ``n_layers`` times. The
  routing is data-independent in shape (``torch.topk``, then every expert computed
  densely and weighted by a scattered gate), so it captures without host syncs.
- :class:`GPT2Stack`: GPT-2-style blocks (LayerNorm, fused qkv, causal attention of the
  new token over its own static KV-cache slot, GELU MLP) and a tied LM head.

Works on CPU (float32) for the tests and on CUDA (bfloat16) for the benches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import graphguard as gg


def _param(
    gen: torch.Generator, *shape: int, scale: float, device: torch.device, dtype: torch.dtype
) -> nn.Parameter:
    t = torch.randn(*shape, generator=gen) * scale
    return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)


class MoEBlock(nn.Module):
    """A stack of MoE layers with an auxiliary-stream shared expert; ``step(tokens)``."""

    def __init__(
        self,
        *,
        vocab: int = 32000,
        d: int = 1024,
        experts: int = 8,
        top_k: int = 2,
        hidden: int = 1024,
        shared_hidden: int = 2048,
        n_layers: int = 2,
        max_batch: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        use_aux: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        self.d, self.experts, self.top_k, self.hidden = d, experts, top_k, hidden
        self.max_batch = max_batch
        self.vocab = vocab
        self.device, self.dtype = dev, dtype
        self.use_aux = use_aux
        self.embed = _param(g, vocab, d, scale=1.0, device=dev, dtype=dtype)
        self.router = nn.ParameterList(
            [_param(g, experts, d, scale=d**-0.5, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        # All experts' gate/up in one matrix: [E * 2h, d]; down: [E, h, d].
        self.w_gate_up = nn.ParameterList(
            [
                _param(g, experts * 2 * hidden, d, scale=d**-0.5, device=dev, dtype=dtype)
                for _ in range(n_layers)
            ]
        )
        self.w_down = nn.ParameterList(
            [
                _param(g, experts, hidden, d, scale=hidden**-0.5, device=dev, dtype=dtype)
                for _ in range(n_layers)
            ]
        )
        self.s_gate_up = nn.ParameterList(
            [
                _param(g, 2 * shared_hidden, d, scale=d**-0.5, device=dev, dtype=dtype)
                for _ in range(n_layers)
            ]
        )
        self.s_down = nn.ParameterList(
            [
                _param(g, d, shared_hidden, scale=shared_hidden**-0.5, device=dev, dtype=dtype)
                for _ in range(n_layers)
            ]
        )
        self.lm_head = _param(g, vocab, d, scale=d**-0.5, device=dev, dtype=dtype)
        self.aux = gg.AuxStream("moe-shared-expert", device=dev)

    def _shared(self, x: Tensor, i: int) -> Tensor:
        gate, up = F.linear(x, self.s_gate_up[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.s_down[i])

    def _routed(self, x: Tensor, i: int) -> Tensor:
        b = x.shape[0]
        logits = F.linear(x, self.router[i]).float()
        top_w, top_i = torch.topk(logits, self.top_k, dim=-1)
        gates = torch.zeros_like(logits).scatter_(1, top_i, torch.softmax(top_w, dim=-1))
        gu = F.linear(x, self.w_gate_up[i]).view(b, self.experts, 2, self.hidden)
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1]  # [B, E, h]
        act = act * gates.to(act.dtype).unsqueeze(-1)  # unselected experts weigh 0
        # sum_e act[b, e] @ w_down[e]: one batched matmul over experts, then a sum.
        out = torch.bmm(act.transpose(0, 1), self.w_down[i])  # [E, B, d]
        return out.sum(0)

    def step(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, vocab]`` of one decode step; ``tokens`` is ``[B]`` int64."""
        h = self.embed[tokens]
        for i in range(len(self.router)):
            x = F.rms_norm(h, (self.d,))
            # Under torch.compile the branch runs inline: dynamo cannot trace record_stream,
            # and the fork's phase check would recompile between warmup and capture.
            if self.use_aux and not torch.compiler.is_compiling():
                with self.aux.fork(x) as br:
                    shared = self._shared(x, i)
                    br.keep(shared)
                    with br.on_main():
                        routed = self._routed(x, i)
            else:
                shared = self._shared(x, i)
                routed = self._routed(x, i)
            h = h + routed + shared
        return F.linear(F.rms_norm(h, (self.d,)), self.lm_head)

    def example_inputs(self, batch: int, *, seed: int = 0) -> tuple[Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.vocab, (batch,), generator=g).to(self.device),)

    def pad_fill_values(self) -> tuple[int]:
        return (0,)


class GPT2Stack(nn.Module):
    """GPT-2-style blocks over a static per-slot KV cache: ``step(tokens, positions, slots)``.

    Slot ``max_batch`` is the scratch slot padded rows write to.
    """

    def __init__(
        self,
        *,
        vocab: int = 50257,
        d: int = 768,
        heads: int = 12,
        n_layers: int = 4,
        context: int = 256,
        max_batch: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        self.d, self.heads, self.hd = d, heads, d // heads
        self.context, self.max_batch, self.vocab = context, max_batch, vocab
        self.device, self.dtype = dev, dtype
        self.wte = _param(g, vocab, d, scale=0.02, device=dev, dtype=dtype)
        self.wpe = _param(g, context, d, scale=0.01, device=dev, dtype=dtype)
        self.ln1 = nn.ModuleList(
            [nn.LayerNorm(d, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        self.ln2 = nn.ModuleList(
            [nn.LayerNorm(d, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        self.ln_f = nn.LayerNorm(d, device=dev, dtype=dtype)
        self.qkv = nn.ParameterList(
            [_param(g, 3 * d, d, scale=d**-0.5, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        self.proj = nn.ParameterList(
            [_param(g, d, d, scale=d**-0.5, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        self.fc = nn.ParameterList(
            [_param(g, 4 * d, d, scale=d**-0.5, device=dev, dtype=dtype) for _ in range(n_layers)]
        )
        self.fc_proj = nn.ParameterList(
            [
                _param(g, d, 4 * d, scale=(4 * d) ** -0.5, device=dev, dtype=dtype)
                for _ in range(n_layers)
            ]
        )
        # [layers, 2, slots (+1 scratch), heads, context, hd]
        self.register_buffer(
            "kv",
            torch.zeros(
                n_layers, 2, max_batch + 1, heads, context, self.hd, device=dev, dtype=dtype
            ),
        )
        self.register_buffer("ctx_range", torch.arange(context, device=dev))
        self.register_buffer("head_range", torch.arange(heads, device=dev))
        for m in [*self.ln1, *self.ln2, self.ln_f]:
            m.requires_grad_(False)

    def step(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Logits ``[B, vocab]``: row ``b`` writes its key/value at ``kv[:, :, slots[b],
        :, positions[b]]`` and attends to positions ``0..positions[b]`` of that slot."""
        b = tokens.shape[0]
        h = self.wte[tokens] + self.wpe[positions]
        keep = (self.ctx_range <= positions.unsqueeze(1)).view(b, 1, 1, self.context)
        # (slot, head, position) per row and head: the new key/value's place in the cache
        where = (slots.view(-1, 1), self.head_range.view(1, -1), positions.view(-1, 1))
        for i in range(len(self.qkv)):
            x = self.ln1[i](h)
            q, k, v = F.linear(x, self.qkv[i]).view(b, 3, self.heads, self.hd).unbind(1)
            cache = self.kv[i]
            cache[0].index_put_(where, k)
            cache[1].index_put_(where, v)
            keys = cache[0].index_select(0, slots)  # [B, H, T, hd]: one static slot per row
            vals = cache[1].index_select(0, slots)
            a = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=keep)
            h = h + F.linear(a.reshape(b, self.d), self.proj[i])
            x = self.ln2[i](h)
            h = h + F.linear(F.gelu(F.linear(x, self.fc[i]), approximate="tanh"), self.fc_proj[i])
        return F.linear(self.ln_f(h), self.wte)

    def example_inputs(self, batch: int, *, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (batch,), generator=g)
        positions = torch.randint(0, self.context, (batch,), generator=g)
        slots = torch.randperm(self.max_batch, generator=g)[:batch]
        return tokens.to(self.device), positions.to(self.device), slots.to(self.device)

    def pad_fill_values(self) -> tuple[int, int, int]:
        return (0, 0, self.max_batch)


__all__ = ["GPT2Stack", "MoEBlock"]
