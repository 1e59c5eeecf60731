"""Stateful decode over a static KV cache with a device-side position counter (real graphs),
and failure-atomic capture on a real capture stream."""

from __future__ import annotations

import logging

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.phase import Phase

MAX_BATCH, MAX_LEN, DIM = 16, 256, 32
SIZES = [1, 2, 4, 8, 16]


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)
        self.register_buffer("kv_cache", torch.zeros(MAX_BATCH, MAX_LEN, DIM))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        k = self.proj(x)
        self.kv_cache[:n].index_copy_(1, self.pos.view(1), k[:, None, :])
        self.pos.add_(1)
        return self.kv_cache[:n].sum(dim=1) / (self.pos + 1)


def fresh() -> Decoder:
    torch.manual_seed(0)
    m = Decoder().cuda().eval()
    m.kv_cache.normal_()
    m.pos.fill_(5)
    return m


@torch.no_grad()
def test_capture_leaves_state_verify_and_200_decode_steps_equal_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    m = fresh()
    cache0, pos0 = m.kv_cache.clone(), m.pos.clone()
    r = gg.GraphRunner(m.step, (torch.zeros(2, DIM, device="cuda"),), sizes=SIZES, state=m)
    r.capture()
    torch.cuda.synchronize()
    assert torch.equal(m.kv_cache, cache0) and int(m.pos) == int(pos0)
    r.verify()  # graph and eager from the same starting state (no DivergenceError)
    torch.cuda.synchronize()
    assert torch.equal(m.kv_cache, cache0) and int(m.pos) == int(pos0)
    ref = fresh()
    n = 5
    for step in range(200):
        if int(ref.pos) >= MAX_LEN - 1:
            break
        x = torch.randn(n, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        torch.testing.assert_close(r(x), ref.step(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.kv_cache[:n], ref.kv_cache[:n], rtol=1e-4, atol=1e-4)
    assert int(m.pos) == int(ref.pos)
    r.release()


@torch.no_grad()
def test_undeclared_cache_is_named_in_one_warning(caplog):
    m = fresh()
    r = gg.GraphRunner(m.step, (torch.zeros(2, DIM, device="cuda"),), sizes=[2, 4])
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r.capture()
    msgs = [x.getMessage() for x in caplog.records if "outside the static inputs" in x.getMessage()]
    assert len(msgs) == 1 and "kv_cache" in msgs[0] and "pos" in msgs[0]
    r.release()


@pytest.mark.parametrize("kind", [KeyboardInterrupt, gg.errors.BusyStreamError, RuntimeError])
@torch.no_grad()
def test_interrupt_mid_ladder_drops_graphs_and_retries_on_a_real_stream(kind):
    m = fresh()
    ws = gg.Workspace("scratch", "cuda")
    armed = [True]

    def step(x: torch.Tensor) -> torch.Tensor:
        if armed[0] and phase.is_capturing() and x.shape[0] == 4:
            armed[0] = False
            raise kind("injected")
        buf = ws.get(((x.shape[0], DIM), torch.float32))[0]
        torch.mul(x, 2.0, out=buf)
        return m.step(buf)

    r = gg.GraphRunner(
        step, (torch.zeros(2, DIM, device="cuda"),), sizes=SIZES, workspaces=[ws], state=m
    )
    with pytest.raises(gg.errors.GraphCaptureError if kind is RuntimeError else kind):
        r.capture()
    if kind is RuntimeError:
        assert r.captured_sizes == (8, 16) and ws.locked and phase.current_phase() is Phase.SERVING
        r.recapture(reason="retry")
    else:
        assert r.captured_sizes == () and not ws.locked and phase.current_phase() is Phase.EAGER
        r.capture()
    assert r.captured_sizes == tuple(SIZES) and ws.locked
    ref = fresh()
    x = torch.randn(3, DIM, device="cuda")
    torch.testing.assert_close(r(x), ref.step(x * 2.0), rtol=1e-4, atol=1e-4)
    r.release()
