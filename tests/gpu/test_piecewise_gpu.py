"""PIECEWISE on real CUDA graphs: replay equals eager, one compile, a bounded pool, and
FULL_AND_PIECEWISE through the dispatcher (GraphRunner for decode, PiecewiseRunner for mixed).

Self-contained: the model and its custom attention op are defined here.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import graphguard as gg
from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan
from graphguard.piecewise import PiecewiseRunner

HEADS = 4
D = 256
MEM = 64


@torch.library.custom_op("gg_gpu_test::attn", mutates_args=())
def attn(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Each token attends over a fixed memory (rows independent: padding cannot leak)."""
    n = q.shape[0]
    qh = q.view(n, HEADS, 1, D // HEADS)
    k = kv[0].unsqueeze(0).expand(n, -1, -1, -1)
    v = kv[1].unsqueeze(0).expand(n, -1, -1, -1)
    return F.scaled_dot_product_attention(qh, k, v).reshape(n, D)


@attn.register_fake
def _(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


class Model(torch.nn.Module):
    """Embedding, then per layer RMSNorm -> q -> attention op -> o -> SwiGLU MLP, residuals."""

    def __init__(self, layers: int = 3, hidden: int = 512) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def p(*shape: int, scale: float = 1.0) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embed = p(1000, D)
        self.kv = torch.nn.ParameterList([p(2, HEADS, MEM, D // HEADS) for _ in range(layers)])
        self.q = torch.nn.ParameterList([p(D, D, scale=D**-0.5) for _ in range(layers)])
        self.o = torch.nn.ParameterList([p(D, D, scale=D**-0.5) for _ in range(layers)])
        self.up = torch.nn.ParameterList([p(D, 2 * hidden, scale=D**-0.5) for _ in range(layers)])
        self.down = torch.nn.ParameterList(
            [p(hidden, D, scale=hidden**-0.5) for _ in range(layers)]
        )

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] * scale[:, None]
        for kv, q, o, up, down in zip(self.kv, self.q, self.o, self.up, self.down):
            h = F.rms_norm(x, (D,))
            x = x + torch.ops.gg_gpu_test.attn(h @ q, kv) @ o
            gate, u = (F.rms_norm(x, (D,)) @ up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * u) @ down
        return x


PW_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
FULL_SIZES = [1, 2, 4, 8, 16, 32]


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randint(0, 1000, (n,), device="cuda", generator=g),
        torch.rand(n, device="cuda", generator=g) + 0.5,
    )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return Model().cuda().eval()


def piecewise_runner(model, sizes=PW_SIZES):
    return PiecewiseRunner(
        model,
        inputs(2),
        split_ops=[torch.ops.gg_gpu_test.attn],
        sizes=sizes,
        fill_values=(0, 1.0),
        progress=False,
        name="pw",
    )


@torch.inference_mode()
def test_piecewise_capture_then_replay_equals_eager_for_random_token_counts(model):
    r = piecewise_runner(model)
    report = r.capture()
    try:
        assert report.captured == PW_SIZES
        assert len(r.pieces) == 4  # 3 attention calls split 4 pieces
        assert all(p.captured_sizes == tuple(PW_SIZES) for p in r.pieces)
        rng = random.Random(0)
        counts = [1, 128, 3, 129, 2] + [rng.randint(1, 160) for _ in range(250)]
        worst = 0.0
        for i, n in enumerate(counts):
            x = inputs(n, seed=i)
            out = r(*x).clone()
            ref = model(*x)
            assert out.shape == ref.shape
            worst = max(worst, (out - ref).abs().max().item())
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert r.compile_count == 1, "a token count recompiled the graph"
        print(
            f"piecewise replay vs eager over {len(counts)} token counts: max abs diff {worst:.2e}"
        )
    finally:
        r.release()


@torch.inference_mode()
def test_piecewise_pool_is_about_the_largest_size_not_the_sum_of_sizes(model):
    # Eight sizes close to the largest: were piece outputs kept alive per size, the pool
    # would hold about eight times the largest size's activations.
    sizes = [64, 72, 80, 88, 96, 104, 112, 128]
    r = piecewise_runner(model, sizes)
    report = r.capture()
    try:
        largest = report.sizes[0].pool_growth_bytes
        print(
            f"pool: largest size {largest / 2**20:.1f} MiB, "
            f"total {report.pool_bytes / 2**20:.1f} MiB"
        )
        assert report.pool_bytes <= 2 * largest + 8 * 2**20, report.table()
        x = inputs(100, seed=1)
        torch.testing.assert_close(r(*x), model(*x), rtol=1e-4, atol=1e-4)
    finally:
        r.release()


@torch.inference_mode()
def test_full_and_piecewise_dispatch_equals_eager(model):
    full = gg.GraphRunner(
        model, inputs(2), sizes=FULL_SIZES, fill_values=(0, 1.0), progress=False, name="full"
    )
    pw = piecewise_runner(model)
    plan = DispatchPlan(
        "full_and_piecewise", max_tokens=200, full_sizes=FULL_SIZES, piecewise_sizes=PW_SIZES
    )
    print(plan.table())
    d = Dispatcher(plan, eager=model, full=full, piecewise=pw)
    d.capture()
    try:
        rng = random.Random(1)
        kinds: dict[str, int] = {}
        for i in range(300):
            n = rng.randint(1, 200)
            key = BatchKey.decode(n) if rng.random() < 0.5 else BatchKey.mixed(n, max(1, n // 4))
            kind = d.plan.resolve(key).kind
            kinds[kind] = kinds.get(kind, 0) + 1
            x = inputs(n, seed=i)
            out = d(key, *x).clone()
            torch.testing.assert_close(out, model(*x), rtol=1e-4, atol=1e-4)
        assert set(kinds) == {"full", "piecewise", "none"}, kinds
        assert pw.compile_count == 1
        print(f"dispatch kinds over 300 batches: {kinds}")
    finally:
        full.release()
        pw.release()


@torch.inference_mode()
def test_piecewise_zero_copy_replay_recapture_and_verify_on_cuda(model):
    """The ladder API PIECEWISE gained: static_inputs/replay, recapture, verify."""
    r = piecewise_runner(model)
    assert isinstance(r, gg.PiecewiseRunner)
    r.capture()
    try:
        for i, n in enumerate([5, 128, 1, 77, 3]):
            x = inputs(n, seed=100 + i)
            for view, src in zip(r.static_inputs(n), x):
                view.copy_(src)
            torch.testing.assert_close(r.replay(n).clone(), model(*x), rtol=1e-4, atol=1e-4)
        report = r.recapture(reason="test: recapture on CUDA")
        assert report.captured == PW_SIZES and r.compile_count == 1
        x = inputs(50, seed=7)
        torch.testing.assert_close(r(*x).clone(), model(*x), rtol=1e-4, atol=1e-4)
        assert r.verify(rtol=1e-4, atol=1e-4).ok
    finally:
        r.release()
