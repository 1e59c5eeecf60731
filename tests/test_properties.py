"""Property tests (hypothesis): random ladders, batch sequences, dtypes, fill values, in-place
writers and nested outputs. The runner's output always equals eager, and padded rows never
leak into a later batch (CPU, RecordingBackend)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.config import Mode
from graphguard.dispatch import BatchKey, DispatchPlan
from graphguard.sizes import PaddingTable

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.int16]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fill_for(dtype: torch.dtype) -> st.SearchStrategy[Any]:
    if dtype.is_floating_point:
        return st.floats(-100, 100, allow_nan=False, width=32)
    info = torch.iinfo(dtype)
    return st.integers(max(info.min, -1000), min(info.max, 1000))


def make_fn(structure: str, inplace: bool) -> Any:
    def fn(x: torch.Tensor, y: torch.Tensor) -> Any:
        if inplace:
            x.add_(1)
        a = x * 2 + y[:, :1]
        b = (x - y.sum(dim=1, keepdim=True)).abs()
        if structure == "tensor":
            return a
        if structure == "tuple":
            return a, b
        if structure == "dict":
            return {"a": a, "b": b}
        return (a, {"b": b, "inner": [a + b]})

    return fn


def data(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (
            torch.randn(n, 3, generator=g).to(dtype),
            torch.randn(n, 2, generator=g).to(dtype),
        )
    return (
        torch.randint(-50, 50, (n, 3), generator=g).to(dtype),
        torch.randint(-50, 50, (n, 2), generator=g).to(dtype),
    )


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    ladder = draw(st.lists(st.integers(1, 16), min_size=1, max_size=5, unique=True))
    return {
        "dtype": dtype,
        "ladder": ladder,
        "batches": draw(st.lists(st.integers(1, 20), min_size=1, max_size=8)),
        "fills": (draw(fill_for(dtype)), draw(fill_for(dtype))),
        "inplace": draw(st.booleans()),
        "structure": draw(st.sampled_from(["tensor", "tuple", "dict", "nested"])),
        "warmup_iters": draw(st.integers(0, 2)),
        "share_outputs": draw(st.booleans()),
        "zero_copy": draw(st.booleans()),
    }


@SETTINGS
@given(scenarios())
def test_runner_equals_eager_and_padding_never_leaks(s: dict[str, Any]) -> None:
    gg.phase.reset()
    fn = make_fn(s["structure"], s["inplace"])
    r = gg.GraphRunner(
        fn,
        data(2, s["dtype"], 0),
        sizes=s["ladder"],
        fill_values=s["fills"],
        share_outputs=s["share_outputs"],
        backend=RecordingBackend(),
        progress=False,
        options=gg.CaptureOptions(warmup_iters=s["warmup_iters"]),
    )
    r.capture()
    assert r.captured_sizes == tuple(sorted(s["ladder"]))
    largest = max(s["ladder"])
    for step, n in enumerate(s["batches"]):
        x, y = data(n, s["dtype"], step + 1)
        want = fn(x.clone(), y.clone())
        if s["zero_copy"] and n <= largest:
            views = r.static_inputs(n)
            views[0].copy_(x)
            views[1].copy_(y)
            got = r.replay(n)
        else:
            got = r(x, y)
        torch.testing.assert_close(got, want)
        # Padded rows are refilled before the next replay: a later, smaller batch must not
        # see this batch's rows (checked by the equality on the next iterations), and the
        # buffers past the batch hold the fill value whenever the callable leaves them be.
        if not s["inplace"] and n <= largest:
            pad = n
            for buf, fill in zip(r.static.buffers, s["fills"]):
                tail = buf[pad:]
                if tail.numel():
                    torch.testing.assert_close(
                        tail, torch.full_like(tail, fill), msg=lambda m: f"stale padding: {m}"
                    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True),
    st.integers(1, 320),
)
def test_padding_table_pads_to_the_smallest_captured_size_not_below(
    sizes: list[int], n: int
) -> None:
    t = PaddingTable(sizes)
    p = t.padded(n)
    above = [s for s in sizes if s >= n]
    assert p == (min(above) if above else None)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["full", "piecewise", "full_and_piecewise", "none"]),
    st.integers(1, 200),
    st.integers(1, 4),
    st.data(),
)
def test_plan_decisions_match_a_brute_force_reference(
    mode: str, max_tokens: int, q: int, data_: Any
) -> None:
    if q > max_tokens:
        q = 1
    plan = DispatchPlan(mode, max_tokens=max_tokens, query_len=q)
    for _ in range(10):
        n = data_.draw(st.integers(1, max_tokens + 5))
        d = plan.resolve(BatchKey.mixed(n))
        if d.kind is Mode.NONE:
            assert d.size == n
        else:
            pool = plan.piecewise_sizes if d.kind == "piecewise" else plan.full_sizes
            assert d.size == min(s for s in pool if s >= n)
        if n % q == 0:
            du = plan.resolve(BatchKey.decode(n // q, q))
            if du.kind == "full":
                assert du.size == min(s for s in plan.full_sizes if s >= n)
            elif du.kind is Mode.NONE:
                assert du.size == n
