"""Every mode for a user's own model, built only from what ``import graphguard`` exports.

The model is defined here, not taken from the reference application: a small GPT-2-style
decoder (learned position embeddings, LayerNorm, fused qkv projection, GELU MLP, tied
head) whose attention is its own custom op ``usermodel::attention`` (registered with
``torch.library`` below, with a fake kernel so dynamo can trace it; it writes the KV
cache and attends over it, so it is the PIECEWISE split point). Its inputs are one row
per token: token ids, positions, and the sequence slot.

Checked against an eager copy of the model (same weights, its own cache), in fp32:
PIECEWISE over 300 token-count transitions (every batch a ragged mix of prefill chunks),
and FULL_AND_PIECEWISE over 200 steps alternating uniform decode batches (FULL graphs)
and mixed batches (piecewise graphs). Also: one compile serves every size (the step
uses ``.view`` on the qkv slices), and the dispatcher's table shows the split points.
``tests/test_user_modes.py`` runs the same helpers on the CPU with ``RecordingBackend``.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import graphguard as gg

# ---------------------------------------------------------------- the user's attention op


@torch.library.custom_op("usermodel::attention", mutates_args=("k_cache", "v_cache"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Write each token's k/v at (slot, position), then attend causally over its slot.

    Fixed shapes and no host sync, so it is capturable too (FULL graphs contain it); a
    ragged batch is just rows with different slots and positions.
    """
    k_cache[slots, positions] = k
    v_cache[slots, positions] = v
    keys = k_cache[slots]  # [T, L, H, hd]
    vals = v_cache[slots]
    scores = torch.einsum("thd,tlhd->thl", q, keys) * q.shape[-1] ** -0.5
    seen = torch.arange(k_cache.shape[1], device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals)


@attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, slots):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Cfg:
    vocab: int = 512
    dim: int = 64
    heads: int = 4
    layers: int = 2
    slots: int = 33
    """Sequence slots; the last one is scratch (padded rows write there)."""
    context: int = 128

    @property
    def scratch(self) -> int:
        return self.slots - 1


class Block(torch.nn.Module):
    def __init__(self, cfg: Cfg) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.heads
        self.heads, self.hd = h, d // h
        self.ln_1 = torch.nn.LayerNorm(d)
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.proj = torch.nn.Linear(4 * d, d)
        shape = (cfg.slots, cfg.context, h, d // h)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> Any:
        t = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).split(x.shape[1], dim=-1)
        # `.view`, not `.reshape`: a reshape of these non-contiguous slices checks
        # contiguity, which makes dynamo specialize the token count on 1 (a recompile).
        q, k, v = (y.view(t, self.heads, self.hd) for y in (q, k, v))
        a = torch.ops.usermodel.attention(q, k, v, self.k_cache, self.v_cache, positions, slots)
        x = x + self.c_proj(a.view(t, -1))
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


class UserGPT(torch.nn.Module):
    """GPT-2 style; ``forward(token_ids[T], positions[T], slots[T]) -> logits[T, vocab]``."""

    def __init__(self, cfg: Cfg) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = torch.nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = torch.nn.Embedding(cfg.context, cfg.dim)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = torch.nn.LayerNorm(cfg.dim)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        x = self.wte(token_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x, positions, slots)
        return self.ln_f(x) @ self.wte.weight.t()

    def clear_cache(self) -> None:
        """Zero the caches in place (their addresses are captured in the graphs)."""
        for block in self.blocks:
            block.k_cache.zero_()
            block.v_cache.zero_()


def make_models(cfg: Cfg, device: torch.device) -> tuple[UserGPT, UserGPT]:
    """The served model and an eager copy (same weights, its own cache)."""
    torch.manual_seed(0)
    model = UserGPT(cfg).to(device).eval()
    return model, copy.deepcopy(model)


# ------------------------------------------------------------------------- the batches

Batch = tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]


class Batches:
    """Random engine batches; tracks each slot's length so every batch continues a sequence."""

    def __init__(self, cfg: Cfg, device: torch.device, seed: int) -> None:
        self.cfg, self.device = cfg, device
        self.rng = random.Random(seed)
        self.pos = [0] * cfg.scratch

    def _rows(self, slots: list[int], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        toks: list[int] = []
        pos: list[int] = []
        sl: list[int] = []
        for slot, n in zip(slots, lengths):
            start = self.pos[slot] if self.pos[slot] + n <= self.cfg.context else 0
            toks += [self.rng.randrange(self.cfg.vocab) for _ in range(n)]
            pos += range(start, start + n)
            sl += [slot] * n
            self.pos[slot] = start + n
        return tuple(torch.tensor(x, device=self.device) for x in (toks, pos, sl))

    def mixed(self, n: int) -> Batch:
        """``n`` tokens: a random split into prefill chunks (and decodes) of random slots."""
        reqs = self.rng.randint(1, min(n, self.cfg.scratch))
        cuts = sorted(self.rng.sample(range(1, n), reqs - 1))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        slots = self.rng.sample(range(self.cfg.scratch), reqs)
        return (gg.BatchKey.mixed(n, reqs), *self._rows(slots, lengths))

    def decode(self, reqs: int) -> Batch:
        """``reqs`` requests of one token each: a uniform key."""
        slots = self.rng.sample(range(self.cfg.scratch), reqs)
        return (gg.BatchKey.decode(reqs), *self._rows(slots, [1] * reqs))


def token_counts(steps: int, max_tokens: int, seed: int) -> list[int]:
    """``steps`` token counts, each different from the last, covering 1 and ``max_tokens``."""
    rng = random.Random(seed)
    out = [max_tokens, 1]
    while len(out) < steps:
        n = rng.randint(1, max_tokens)
        if n != out[-1]:
            out.append(n)
    return out[:steps]


# ------------------------------------------------------------------------------ runs


def build(
    model: UserGPT,
    mode: str,
    max_tokens: int,
    backend_factory: Callable[[], Any] | None,
) -> Any:
    cfg = model.cfg
    dev = model.wte.weight.device
    example = (
        torch.zeros(1, dtype=torch.long, device=dev),
        torch.zeros(1, dtype=torch.long, device=dev),
        torch.full((1,), cfg.scratch, dtype=torch.long, device=dev),
    )
    d = gg.build_dispatcher(
        model,
        example,
        mode=mode,
        split_ops=["usermodel::attention"],
        max_tokens=max_tokens,
        fill_values=(0, 0, cfg.scratch),
        names=("token_ids", "positions", "slots"),
        backend_factory=backend_factory,
        progress=False,
        name="usergpt",
    )
    d.capture()
    return d


def check_run(
    mode: str,
    batches: Callable[[Batches], list[Batch]],
    *,
    cfg: Cfg,
    device: torch.device,
    max_tokens: int,
    backend_factory: Callable[[], Any] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> tuple[Counter[str], Any, float]:
    """Serve every batch through the dispatcher and through the eager copy; compare.

    fp32 throughout; the tolerance only covers a matmul over the padded batch picking
    another kernel than over the batch itself (no TF32). Returns which kind ran each
    batch (``"decode:full"``, ``"mixed:piecewise"``), the dispatcher, the worst error.
    """
    model, ref = make_models(cfg, device)
    with torch.no_grad():
        d = build(model, mode, max_tokens, backend_factory)
        model.clear_cache()  # the capture's warmups wrote the scratch slot and slot 0
        ran: Counter[str] = Counter()
        worst = 0.0
        for i, (key, *inputs) in enumerate(batches(Batches(cfg, device, seed=1))):
            kind = d.plan.resolve(key).kind
            ran[f"{'decode' if key.uniform else 'mixed'}:{kind.value}"] += 1
            got = d(key, *inputs)
            want = ref(*inputs)
            worst = max(worst, (got - want).abs().max().item())
            torch.testing.assert_close(
                got, want, atol=atol, rtol=rtol, msg=lambda m, i=i, key=key: f"step {i} {key}: {m}"
            )
        # Padded rows wrote only the scratch slot: every live slot's cache agrees.
        for a, b in zip(model.blocks, ref.blocks):
            for x, y in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
                torch.testing.assert_close(x[: cfg.scratch], y[: cfg.scratch], atol=atol, rtol=rtol)
    return ran, d, worst


def piecewise_batches(steps: int, max_tokens: int) -> Callable[[Batches], list[Batch]]:
    return lambda b: [b.mixed(n) for n in token_counts(steps, max_tokens, seed=2)]


def alternating_batches(
    steps: int, max_tokens: int, max_reqs: int
) -> Callable[[Batches], list[Batch]]:
    def make(b: Batches) -> list[Batch]:
        counts = token_counts(steps, max_tokens, seed=3)
        reqs = token_counts(steps, max_reqs, seed=4)
        return [b.decode(reqs[i]) if i % 2 == 0 else b.mixed(counts[i]) for i in range(steps)]

    return make


def check_split_table(d: Any, layers: int) -> None:
    pw = d.piecewise
    assert pw.compile_count == 1, pw.recompile_reasons  # one compile serves every size
    assert d.reports["piecewise"].compiles == 1
    table = d.table()
    assert f"split at usermodel::attention x{layers} calls, 1 compile" in table, table
    assert f"{layers + 1} pieces" in table, table


# ------------------------------------------------------------------------------ tests

GPU_CFG = Cfg()
GPU_MAX_TOKENS = 64


@pytest.fixture(autouse=True)
def _fresh_dynamo_fp32():
    torch._dynamo.reset()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch._dynamo.reset()


def test_piecewise_over_300_token_count_transitions_equals_eager():
    ran, d, worst = check_run(
        "piecewise",
        piecewise_batches(300, GPU_MAX_TOKENS),
        cfg=GPU_CFG,
        device=torch.device("cuda"),
        max_tokens=GPU_MAX_TOKENS,
    )
    assert ran["mixed:piecewise"] == 300, ran
    check_split_table(d, GPU_CFG.layers)
    print(d.table(), ran, f"worst |graph - eager| = {worst:.2e}")
    d.release()


def test_full_and_piecewise_over_200_alternating_decode_and_mixed_steps_equals_eager():
    ran, d, worst = check_run(
        "full_and_piecewise",
        alternating_batches(200, GPU_MAX_TOKENS, GPU_CFG.scratch),
        cfg=GPU_CFG,
        device=torch.device("cuda"),
        max_tokens=GPU_MAX_TOKENS,
    )
    assert ran["decode:full"] == 100 and ran["mixed:piecewise"] == 100, ran
    check_split_table(d, GPU_CFG.layers)
    assert d.reports["full"].captured == list(d.plan.full_sizes)
    print(d.table(), ran, f"worst |graph - eager| = {worst:.2e}")
    d.release()
