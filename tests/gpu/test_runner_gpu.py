"""The runner on real CUDA graphs: replay equals eager, transitions, capture failures."""

from __future__ import annotations

import random

import pytest
import torch

import graphguard as gg
from graphguard.errors import GraphCaptureError

from .blocks import TinyBlock

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256]


def inputs(n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randint(0, 1000, (n,), device="cuda", generator=g),
        torch.rand(n, device="cuda", generator=g) + 0.5,
    )


@pytest.fixture(scope="module")
def block():
    torch.backends.cuda.matmul.allow_tf32 = False
    return TinyBlock().cuda().eval()


@pytest.fixture
def runner(block):
    r = gg.GraphRunner(
        block, inputs(2), sizes=SIZES, fill_values=(0, 1.0), progress=False, name="tiny"
    )
    with torch.inference_mode():
        r.capture()
    yield r
    r.release()


@torch.inference_mode()
def test_captures_every_size_and_reports_pool(runner):
    assert runner.captured_sizes == tuple(SIZES)
    assert runner.report is not None
    assert runner.report.pool_bytes > 0
    assert runner.report.captured == SIZES


@torch.inference_mode()
@pytest.mark.parametrize("n", SIZES)
def test_replay_is_bitwise_equal_to_eager_at_captured_sizes(runner, block, n):
    x = inputs(n, seed=n)
    out = runner(*x)
    ref = block(*x)
    assert torch.equal(out, ref), (out - ref).abs().max()


@torch.inference_mode()
@pytest.mark.parametrize("n", [3, 5, 17, 33, 100, 255])
def test_padded_replay_matches_eager_and_bitwise_the_padded_eager(runner, block, n):
    x = inputs(n, seed=n)
    out = runner(*x).clone()
    torch.testing.assert_close(out, block(*x), rtol=1e-5, atol=1e-5)
    p = runner.padded_size(n)
    padded = tuple(
        torch.cat([t, torch.full((p - n,), f, dtype=t.dtype, device=t.device)])
        for t, f in zip(x, (0, 1.0))
    )
    assert torch.equal(out, block(*padded)[:n])


@torch.inference_mode()
def test_a_thousand_random_transitions_equal_eager(runner, block):
    rng = random.Random(0)
    seq = [8, 1, 37, 256, 2] + [
        rng.choice([1, 2, 3, 7, 8, 9, 37, 64, 100, 256, 300]) for _ in range(995)
    ]
    worst = 0.0
    for step, n in enumerate(seq):
        x = inputs(n, seed=step)
        out = runner(*x)
        ref = block(*x)
        worst = max(worst, (out - ref).abs().max().item())
        assert out.shape == ref.shape
    assert worst < 1e-4, worst


@torch.inference_mode()
def test_no_synchronize_on_the_replay_path(runner):
    xs = [inputs(n, seed=n) for n in (1, 3, 256, 2, 64)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs * 20:
            runner(*x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@torch.inference_mode()
def test_item_in_the_callable_fails_that_size_and_the_rest_still_work(block):
    def fn(tokens, scale):
        out = block(tokens, scale)
        if tokens.shape[0] == 16:
            _ = out.sum().item()  # host sync: illegal while capturing
        return out

    r = gg.GraphRunner(
        fn,
        inputs(2),
        sizes=[4, 16, 64],
        fill_values=(0, 1.0),
        progress=False,
        options=gg.CaptureOptions(on_capture_error="skip"),
    )
    report = r.capture()
    assert report.failed == [16]
    assert r.captured_sizes == (4, 64)
    failed = next(s for s in report.sizes if not s.ok)
    assert failed.error
    for n in (3, 16, 10, 64):
        x = inputs(n, seed=n)
        torch.testing.assert_close(r(*x), block(*x), rtol=1e-5, atol=1e-5)
    r.release()


@torch.inference_mode()
def test_item_raise_mode_gives_graph_capture_error_naming_the_size(block):
    def fn(tokens, scale):
        out = block(tokens, scale)
        if tokens.shape[0] == 16:
            _ = out.sum().item()
        return out

    r = gg.GraphRunner(fn, inputs(2), sizes=[4, 16, 64], fill_values=(0, 1.0), progress=False)
    with pytest.raises(GraphCaptureError) as ei:
        r.capture()
    assert ei.value.size == 16
    assert "size 16" in str(ei.value)
    print("GraphCaptureError message:", ei.value)
    assert r.captured_sizes == (64,)
    x = inputs(5)
    torch.testing.assert_close(r(*x), block(*x), rtol=1e-5, atol=1e-5)
    # eager work on the default stream is unaffected by the aborted capture
    y = torch.randn(1000, device="cuda") * 2
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    r.release()


@torch.inference_mode()
def test_pool_of_whole_ladder_stays_close_to_largest_alone(block):
    alone = gg.GraphRunner(block, inputs(2), sizes=[256], fill_values=(0, 1.0), progress=False)
    a = alone.capture().pool_bytes
    alone.release()
    ladder = gg.GraphRunner(
        block, inputs(2), sizes=gg.capture_sizes(256), fill_values=(0, 1.0), progress=False
    )
    b = ladder.capture().pool_bytes
    print(
        f"pool: largest alone {a} B, ladder of {len(ladder.captured_sizes)} "
        f"{b} B, ratio {b / a:.3f}"
    )
    assert b <= 1.1 * a  # unowned outputs: every graph's output blocks go back to the pool
    ladder.release()


@torch.inference_mode()
def test_outputs_are_non_owning_views_that_smaller_graphs_reuse(block):
    """With share_outputs each graph keeps non-owning views of its outputs: their blocks
    went back to the pool, so a smaller graph may write where a larger one's outputs were,
    and interleaved calls (each output read before the next call) still equal eager."""
    r = gg.GraphRunner(block, inputs(2), sizes=[8, 64, 256], fill_values=(0, 1.0), progress=False)
    r.capture()
    try:
        leaves = r.graph_outputs
        assert set(leaves) == {8, 64, 256}
        ptrs = {s: leaves[s][0].untyped_storage().data_ptr() for s in leaves}
        print("output storage pointers per size:", {s: hex(p) for s, p in ptrs.items()})
        for step, n in enumerate([256, 3, 64, 8, 200, 1, 256]):
            x = inputs(n, seed=step)
            out = r(*x)
            assert out.data_ptr() == leaves[r.padded_size(n)][0].data_ptr()
            torch.testing.assert_close(out, block(*x), rtol=1e-5, atol=1e-5)
    finally:
        r.release()


@torch.inference_mode()
def test_sanitizer_poisons_outputs_held_across_release(block):
    from graphguard.errors import StaleOutputError

    r = gg.GraphRunner(
        block, inputs(2), sizes=[4, 8], fill_values=(0, 1.0), progress=False, sanitize=True
    )
    r.capture()
    out = r(*inputs(3))
    r.release()  # the pool is freed; `out` pointed into it
    with pytest.raises((StaleOutputError, RuntimeError), match=r"release\(\)"):
        out.sum()


def test_inputs_that_require_grad_replay_detached_and_the_runner_keeps_working(runner, block):
    """Grad mode on, an input that requires grad: a detached replay, static buffers untouched."""
    tokens, scale = inputs(5, seed=3)
    scale.requires_grad_(True)
    out = runner(tokens, scale).clone()
    with torch.inference_mode():
        torch.testing.assert_close(out, block(tokens, scale.detach()), rtol=1e-4, atol=1e-4)
    assert not any(b.requires_grad for b in runner.static.buffers)
    with torch.inference_mode():
        for n in (7, 64, 2):
            x = inputs(n, seed=n)
            torch.testing.assert_close(runner(*x).clone(), block(*x), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_non_batch_output_with_first_dim_equal_to_the_largest_size_is_whole(block):
    table = torch.arange(64.0, device="cuda")

    def fn(tokens, scale):
        return block(tokens, scale), table * 2

    r = gg.GraphRunner(fn, inputs(2), sizes=[8, 16, 64], fill_values=(0, 1.0), progress=False)
    r.capture()
    try:
        for n in (3, 64, 9):
            y, t = r(*inputs(n, seed=n))
            assert t.shape == (64,)
            torch.testing.assert_close(t, table * 2)
            torch.testing.assert_close(y, block(*inputs(n, seed=n)), rtol=1e-4, atol=1e-4)
    finally:
        r.release()
