"""Issue 20 items 1 and 2 on real CUDA graphs: ambient autocast and random numbers like eager.

1. Autocast: a runner captured inside the caller's ``torch.autocast`` (weight-cast cache
   on, the default) stays correct after the block ends, after NaN-filled allocations
   recycle every freed block and after a second runner captures: 100 replays equal eager
   under the same autocast. The hand-rolled ``torch.cuda.graph`` capture of the same model
   (``handrolled``) bakes autocast's cached weight copies and replays NaN afterwards.
2. RNG: a step sampling from its own ``torch.Generator`` (and one from the default
   generator) over a ladder: capture consumes no randomness, 50 replays (padded batches
   included) draw exactly eager's numbers from the same seed, and ``verify()`` passes; a
   dropout step verifies clean; a reseed inside the step and a generator graphguard cannot
   see are refused at capture with the RNG cause. The hand-rolled capture of a step with
   its own generator fails outright.

The ``handrolled`` tests are the unprotected variants; ``scripts/gpu_suite.sh memcheck``
runs both groups under ``compute-sanitizer --tool memcheck``.
"""

from __future__ import annotations

import math

import pytest
import torch

import graphguard as gg
from graphguard.errors import GraphCaptureError
from graphguard.verify import default_tolerance

D = 256
H = 1024
V = 1000
SIZES = [1, 2, 4, 8]
BATCHES = [1, 2, 3, 4, 5, 6, 7, 8]  # padded ones included


def say(*args: object) -> None:
    print("[semantics]", *args, flush=True)


def rand(n: int, seed: int, d: int = D) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, d, device="cuda", generator=g)


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# =============================================================================== autocast


class MLP(torch.nn.Module):
    """fp32 weights that require grad: what autocast caches casts of."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(D, H)
        self.fc2 = torch.nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def nan_flood(model: torch.nn.Module, dtype: torch.dtype, on: list[torch.cuda.Stream]) -> list:
    """NaN-filled tensors of every cast weight's size (and larger), on each stream: the
    caching allocator hands out the blocks autocast's cache freed (blocks are per stream)."""
    sizes = sorted({p.numel() for p in model.parameters()} | {4 * D * H})
    keep = []
    for stream in on:
        with torch.cuda.stream(stream):
            for numel in sizes:
                for _ in range(24):
                    keep.append(torch.full((numel,), math.nan, dtype=dtype, device="cuda"))
    torch.cuda.synchronize()
    return keep


def tol(dtype: torch.dtype) -> dict[str, float]:
    rtol, atol = default_tolerance(dtype)
    return {"rtol": rtol, "atol": atol}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@torch.inference_mode()
def test_capture_under_ambient_autocast_stays_correct_after_the_block_and_another_capture(
    dtype: torch.dtype,
):
    m = MLP(seed=0).cuda()
    example = (torch.zeros(1, D, device="cuda"),)
    with torch.autocast("cuda", dtype=dtype):
        m(rand(4, seed=99))  # the caller's own eager call fills autocast's cache first
        r = gg.GraphRunner(m, example, sizes=SIZES, progress=False, name="ambient")
        report = r.capture()
        assert torch.is_autocast_cache_enabled()  # the caller's cache flag is back
        x = rand(5, seed=1)
        torch.testing.assert_close(r(x), m(x), **tol(dtype))
    assert report.autocast == f"cuda {str(dtype).removeprefix('torch.')}"
    torch.cuda.synchronize()
    streams = [torch.cuda.current_stream(), r.backend.capture_stream]
    keep = nan_flood(m, dtype, streams)
    other = MLP(seed=1).cuda()
    r2 = gg.GraphRunner(other, example, sizes=SIZES, progress=False, name="second")
    r2.capture()
    keep += nan_flood(m, dtype, streams)
    worst = 0.0
    for i in range(100):
        x = rand(BATCHES[i % len(BATCHES)], seed=i)
        out = r(x)  # outside the block: the graph keeps its dtype policy
        with torch.autocast("cuda", dtype=dtype):
            ref = m(x)
        assert out.dtype == dtype
        assert not out.isnan().any(), f"replay {i} read freed autocast cache memory"
        torch.testing.assert_close(out, ref, **tol(dtype))
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
    big = rand(12, seed=500)  # above the ladder: eager, under the captured policy
    with torch.autocast("cuda", dtype=dtype):
        ref_big = m(big)
    assert r(big).dtype == dtype
    torch.testing.assert_close(r(big), ref_big, **tol(dtype))
    assert r.verify().ok  # outside the block: the eager reference runs under bf16/fp16 too
    torch.testing.assert_close(r2(x), other(x), rtol=1e-4, atol=1e-4)
    say(f"ambient {dtype}: 100 replays after the block, max |diff| {worst:.3e}; {len(keep)} NaN")
    del keep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@torch.no_grad()
def test_handrolled_capture_under_ambient_autocast_replays_freed_weight_casts(
    dtype: torch.dtype,
):
    m = MLP(seed=0).cuda()
    static_x = torch.zeros(8, D, device="cuda")
    x = rand(8, seed=3)
    side = torch.cuda.Stream()
    with torch.autocast("cuda", dtype=dtype):  # cache_enabled: the default, True
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                m(static_x)  # caches the weight casts (general pool, side stream)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            out = m(static_x)  # finds the casts cached: records no cast, bakes their address
        static_x.copy_(x)
        g.replay()
        ref = m(x)
        torch.cuda.synchronize()
        inside = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(out, ref, **tol(dtype))  # correct while the cache lives
    keep = nan_flood(m, dtype, [side, torch.cuda.current_stream()])
    static_x.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    wrong = int((out.isnan() | ((out.float() - ref.float()).abs() > 1.0)).sum().item())
    say(f"hand-rolled {dtype}: inside the block |diff| {inside:.3e}; after it {wrong} bad values")
    assert wrong > 0, "the hand-rolled graph was expected to replay the freed weight casts"
    del keep, g


# ==================================================================================== RNG


class Sampler(torch.nn.Module):
    """On-device sampling: Gumbel-max over logits plus a normal draw, from ``gen`` (its
    own generator) or, with ``gen=None``, the default CUDA generator."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(D, V)
        self.gen = torch.Generator(device="cuda").manual_seed(1234) if own else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        u = torch.rand(logits.shape, device=x.device, generator=self.gen)
        noise = torch.randn(x.shape[0], 8, device=x.device, generator=self.gen)
        return (logits - torch.log(-torch.log(u))).argmax(-1), u, noise


def generator_of(m: Sampler) -> torch.Generator:
    return (
        m.gen if m.gen is not None else torch.cuda.default_generators[torch.cuda.current_device()]
    )


@pytest.mark.parametrize("own", [True, False], ids=["own-generator", "default-generator"])
@torch.inference_mode()
def test_sampling_over_a_ladder_draws_exactly_eagers_numbers_from_the_same_seed(own: bool):
    m = Sampler(own).cuda()
    gen = generator_of(m)
    gen.manual_seed(2024)
    seeded = gen.get_state()
    r = gg.GraphRunner(m, (torch.zeros(1, D, device="cuda"),), sizes=SIZES, progress=False)
    report = r.capture()
    assert ("gen" in report.generators) == own and "default" in report.generators
    assert torch.equal(gen.get_state(), seeded), "capture must consume no randomness"
    xs = [rand(BATCHES[i % len(BATCHES)], seed=i) for i in range(50)]
    graph = [tuple(t.clone() for t in r(x)) for x in xs]
    after_graph = gen.get_state()
    gen.set_state(seeded)
    eager = [m(x) for x in xs]
    assert torch.equal(gen.get_state(), after_graph), "50 replays advance it like 50 calls"
    same_tokens = rows = 0
    for i, ((tok, u, noise), (tok_e, u_e, noise_e), x) in enumerate(zip(graph, eager, xs)):
        assert torch.equal(u, u_e), f"call {i} (batch {x.shape[0]}): uniform draws differ"
        assert torch.equal(noise, noise_e), f"call {i}: normal draws differ"
        # The token: the graph's pick is the maximum of eager's perturbed logits (a padded
        # GEMM may round the logits differently in the last bit).
        score = m.head(x) - torch.log(-torch.log(u_e))
        picked = score.gather(1, tok[:, None]).squeeze(1)
        torch.testing.assert_close(picked, score.max(-1).values, rtol=1e-5, atol=1e-5)
        same_tokens += int((tok == tok_e).sum())
        rows += tok.numel()
    same_size = [g[1] for g, x in zip(graph, xs) if x.shape[0] == 4]
    assert not torch.equal(same_size[0], same_size[1]), "fresh numbers every replay"

    before_verify = gen.get_state()
    assert r.verify().ok
    after_verify = gen.get_state()
    gen.set_state(before_verify)
    # verify leaves it where its eager reference calls would: one per input set, two sets
    # per size (the second one row shorter where that still pads to the size), as in
    # tests/test_rng.py; the replays consume nothing.
    for i, n in enumerate(SIZES):
        m(rand(n, seed=n))
        m(rand(n - 1 if n > 1 and (i == 0 or n - 1 > SIZES[i - 1]) else n, seed=n))
    assert torch.equal(gen.get_state(), after_verify)
    say(
        f"sampling ({'own' if own else 'default'} generator): 50 replays draw eager's numbers; "
        f"tokens identical {same_tokens}/{rows}"
    )


class DropStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), p=0.3, training=True)


@torch.inference_mode()
def test_a_dropout_step_is_verified_clean():
    m = DropStep().cuda()
    x = rand(4, seed=0)
    assert not torch.equal(m(x), m(x)), "the mask is random: a verify that ignores RNG fails"
    r = gg.GraphRunner(m, (torch.zeros(1, D, device="cuda"),), sizes=SIZES, progress=False)
    r.capture()
    report = r.verify()
    assert report.ok and [c.size for c in report.sizes] == SIZES
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    for i in range(20):
        n = SIZES[i % len(SIZES)]
        x = rand(n, seed=i)
        start = gen.get_state()
        out = r(x).clone()
        gen.set_state(start)
        assert torch.equal(out, m(x)), f"replay {i} (size {n})"


class Reseed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator(device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gen.manual_seed(7)  # every call the same numbers, eagerly
        return x + torch.rand(x.shape, device=x.device, generator=self.gen)


@torch.inference_mode()
def test_a_reseed_inside_the_step_is_refused_with_the_rng_cause():
    m = Reseed()
    r = gg.GraphRunner(m, (torch.zeros(1, D, device="cuda"),), sizes=[1, 2], progress=False)
    with pytest.raises(GraphCaptureError) as info:
        r.capture()
    msg = str(info.value)
    say("reseed:", msg[:300])
    assert "Cause: random numbers" in msg and "Seed outside the step" in msg
    assert "must not synchronize the host" not in msg
    # Nothing left in capture mode: eager draws from both generators still work.
    torch.rand(3, device="cuda", generator=m.gen)
    torch.rand(3, device="cuda")
    torch.cuda.synchronize()


class Hidden(torch.nn.Module):
    """Keeps its generator under a private name, where graphguard does not look."""

    def __init__(self) -> None:
        super().__init__()
        self._g = torch.Generator(device="cuda").manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, device=x.device, generator=self._g)


@torch.inference_mode()
def test_a_generator_graphguard_cannot_see_is_named_in_the_error_and_works_once_passed():
    m = Hidden()
    ex = (torch.zeros(1, D, device="cuda"),)
    blind = gg.GraphRunner(m, ex, sizes=SIZES, progress=False)
    try:
        blind.capture()
    except GraphCaptureError as err:
        msg = str(err)
        say("hidden generator:", msg[:300])
        assert "Cause: random numbers" in msg and "generators=[g]" in msg
    else:  # a torch that registers generators lazily: then it must be right
        say("hidden generator: this torch captured it without registration")
        start = m._g.get_state()
        out = blind(rand(3, seed=0)).clone()
        m._g.set_state(start)
        assert torch.equal(out, m(rand(3, seed=0)))
    told = gg.GraphRunner(
        m, ex, sizes=SIZES, progress=False, options=gg.CaptureOptions(generators=[m._g])
    )
    told.capture()
    for i in range(20):
        x = rand(BATCHES[i % len(BATCHES)], seed=i)
        start = m._g.get_state()
        out = told(x).clone()
        m._g.set_state(start)
        assert torch.equal(out, m(x)), i
    assert told.verify().ok


@torch.no_grad()
def test_handrolled_capture_of_a_step_with_its_own_generator_fails():
    gen = torch.Generator(device="cuda").manual_seed(0)
    static_x = torch.zeros(8, D, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _ = static_x + torch.rand(static_x.shape, device="cuda", generator=gen)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="generator not in capture mode"):
        with torch.cuda.graph(g, stream=side):
            _ = static_x + torch.rand(static_x.shape, device="cuda", generator=gen)
    torch.cuda.synchronize()
