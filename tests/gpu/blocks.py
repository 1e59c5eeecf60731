"""Small models for the GPU tests: rows independent, so padding cannot change real rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TinyBlock(torch.nn.Module):
    """RMSNorm -> cross-attention of each row over a fixed memory -> SwiGLU MLP, residuals."""

    def __init__(self, d: int = 256, heads: int = 4, mem: int = 64, hidden: int = 512) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads = heads
        self.q = torch.nn.Parameter(torch.randn(d, d, generator=g) * d**-0.5)
        self.kv_mem = torch.nn.Parameter(torch.randn(2, heads, mem, d // heads, generator=g))
        self.o = torch.nn.Parameter(torch.randn(d, d, generator=g) * d**-0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(d, 2 * hidden, generator=g) * d**-0.5)
        self.down = torch.nn.Parameter(torch.randn(hidden, d, generator=g) * hidden**-0.5)
        self.embed = torch.nn.Parameter(torch.randn(1000, d, generator=g))

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] * scale[:, None]
        h = F.rms_norm(x, (x.shape[-1],))
        b, d = h.shape
        q = (h @ self.q).view(b, self.heads, 1, d // self.heads)
        k = self.kv_mem[0].unsqueeze(0).expand(b, -1, -1, -1)
        v = self.kv_mem[1].unsqueeze(0).expand(b, -1, -1, -1)
        a = F.scaled_dot_product_attention(q, k, v).reshape(b, d)
        x = x + a @ self.o
        gu = F.rms_norm(x, (d,)) @ self.gate_up
        gate, up = gu.chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down
