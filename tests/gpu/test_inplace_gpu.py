"""torch.cuda.graph's semantics on real CUDA graphs: in-place argument writes, output
layouts at one and several sizes, verify() never green on nothing.

A graph reads its inputs from static buffers, so a step that writes an argument writes
the static copy; graphguard copies the written rows back into the caller's tensor after
the replay (stream-ordered, no sync). Every case compares the caller-visible result
(outputs and the arguments) with eager on clones of the same inputs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError

D = 64
LADDERS = {"one size": [16], "ladder": [1, 2, 4, 8, 16]}


def weight() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(D, D, device="cuda", generator=g) * D**-0.5


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randn(n, D, device="cuda", generator=g),
        torch.randint(0, 100, (n,), device="cuda", generator=g),
    )


def build(fn: Callable[..., Any], sizes: list[int], **kw: Any) -> gg.GraphRunner:
    kw.setdefault("fill_values", (1.0, 1))
    return gg.GraphRunner(fn, inputs(2, seed=0), sizes=sizes, progress=False, **kw)


def check_like_eager(r: gg.GraphRunner, fn: Callable[..., Any], n: int, seed: int) -> None:
    mine = inputs(n, seed)
    theirs = tuple(x.clone() for x in mine)
    got = r(*mine)
    want = fn(*theirs)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


def steps() -> dict[str, Callable[..., Any]]:
    w = weight()

    def add_in_place(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return x @ w + idx[:, None].to(x.dtype)

    def out_argument(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        torch.add(idx, 7, out=idx)
        return torch.tanh(x @ w)

    def behind_torchs_back(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x.data.mul_(2.0)  # not counted by x's version counter: seen by the contents check
        return x @ w

    return {"add_": add_in_place, "out=": out_argument, ".data": behind_torchs_back}


@pytest.fixture(autouse=True)
def _synchronize_after():
    yield
    torch.cuda.synchronize()


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("sizes", LADDERS.values(), ids=LADDERS.keys())
@pytest.mark.parametrize("kind", ["add_", "out=", ".data"])
def test_in_place_argument_writes_equal_eagers_caller_visible_result(kind, sizes, grad_mode):
    fn = steps()[kind]
    mode = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    with mode():
        r = build(fn, sizes)
        r.capture()
        rnd = random.Random(0)
        for step in range(50):
            n = rnd.choice([1, 3, sizes[-1], rnd.randint(1, sizes[-1])])
            check_like_eager(r, fn, n, seed=step)
        # The written rows went back through the fast path (a replay), not eagerly.
        assert r.door.entries[sizes[-1]] is not None and r.door.entries[sizes[-1]].writeback
        r.release()


@torch.inference_mode()
def test_a_step_that_writes_nothing_keeps_the_plain_replay_path():
    w = weight()
    r = build(lambda x, idx: x @ w, LADDERS["ladder"])
    r.capture()
    assert all(e is None or not e.writeback for e in r.door.entries)
    check_like_eager(r, lambda x, idx: x @ w, 3, seed=1)
    r.release()


@torch.inference_mode()
def test_zero_copy_path_writes_land_in_the_static_views():
    fn = steps()["add_"]
    r = build(fn, LADDERS["ladder"])
    r.capture()
    x, idx = inputs(3, seed=4)
    views = r.static_inputs(3)
    views[0].copy_(x)
    views[1].copy_(idx)
    got = r.replay(3).clone()
    torch.testing.assert_close(got, fn(x.clone(), idx))
    torch.testing.assert_close(views[0], x + 1)
    r.release()


def features_by_batch(w: torch.Tensor) -> Callable[..., Any]:
    return lambda x, idx: (x @ w).t()  # [features, batch]


def constant_output(w: torch.Tensor) -> Callable[..., Any]:
    table = torch.randn(16, 16, device="cuda")  # first dim equals the largest size

    return lambda x, idx: (x @ w, table * 2)


@torch.inference_mode()
@pytest.mark.parametrize("sizes", [[16], [1, 2, 4, 8, 16]], ids=["one size", "ladder"])
@pytest.mark.parametrize("make", [features_by_batch, constant_output])
def test_output_layouts_equal_eager_at_one_and_several_sizes(make, sizes):
    fn = make(weight())
    r = build(fn, sizes)
    r.capture()
    for step, n in enumerate([3, 16, 1, 7, 16, 2]):
        x = inputs(n, seed=step)
        got, want = r(*x), fn(*x)
        torch.testing.assert_close(got, want)
    r.release()


@torch.inference_mode()
@pytest.mark.parametrize("sizes", [[16], [1, 2, 4, 8, 16]], ids=["one size", "ladder"])
def test_an_ambiguous_output_is_refused_and_nothing_is_captured(sizes):
    w = weight()
    r = build(lambda x, idx: (x @ w, torch.cat([x, x])), sizes)
    with pytest.raises(GraphCaptureError, match=r"output\[1\] is float32 \[\d+, 64\] at batch"):
        r.capture()
    assert r.captured_sizes == ()


@torch.inference_mode()
def test_verify_raises_on_nothing_and_on_another_batch_and_lists_what_replayed():
    w = weight()
    r = build(lambda x, idx: x @ w, [1, 2, 4, 8])
    with pytest.raises(GraphGuardError, match="capture\\(\\) has not run yet"):
        r.verify()
    r.capture()
    with pytest.raises(ConfigError, match=r"make_inputs\(1\) returned a batch of 2"):
        r.verify(make_inputs=lambda n: inputs(n + 1, seed=n))
    report = r.verify(make_inputs=lambda n: inputs(max(1, n - 1) if n > 2 else n, seed=n))
    assert [(c.size, c.batch, c.graph) for c in report.sizes] == [
        (1, 1, 1),
        (2, 2, 2),
        (4, 3, 4),
        (8, 7, 8),
    ]
    r.release()
    with pytest.raises(GraphGuardError, match="released"):
        r.verify()


@torch.inference_mode()
def test_verify_checks_the_arguments_a_step_writes():
    fn = steps()["add_"]
    r = build(fn, [1, 2, 4, 8])
    r.capture()
    assert r.verify().ok
    r.release()


@torch.inference_mode()
def test_verify_raises_when_every_size_failed_under_skip():
    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x + float(x.sum())  # a host sync: every size fails to capture

    r = build(fn, [2, 4], options=gg.CaptureOptions(on_capture_error="skip"))
    report = r.capture()
    assert report.captured == []
    with pytest.raises(GraphGuardError, match="every size failed to capture"):
        r.verify()


@torch.inference_mode()
@pytest.mark.parametrize("sizes", [[16], [1, 2, 4, 8, 16]], ids=["one size", "ladder"])
def test_piecewise_layouts_and_written_arguments_equal_eager(sizes):
    torch._dynamo.reset()
    w = weight()

    def step(x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc.add_(x)  # an argument written in place
        h = torch.relu(x @ w)  # the split op: runs eagerly between the pieces
        return (h @ w).t(), w * 2  # [features, batch] and a constant [64, 64]

    example = (torch.zeros(2, D, device="cuda"), torch.zeros(2, D, device="cuda"))
    r = gg.PiecewiseRunner(step, example, split_ops=[torch.relu], sizes=sizes, progress=False)
    r.capture()
    for seed, n in enumerate([3, 16, 1, 7]):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x, acc = (torch.randn(n, D, device="cuda", generator=g) for _ in range(2))
        x2, acc2 = x.clone(), acc.clone()
        got = r(x, acc)
        want = step(x2, acc2)
        torch.cuda.synchronize()
        assert got[0].shape == (D, n) and got[1].shape == (D, D)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(acc, acc2)
    r.release()
    torch._dynamo.reset()
