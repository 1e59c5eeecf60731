"""RNG and autocast semantics on the CPU (RecordingBackend): the plumbing the GPU relies on.

Generators the step draws from are found (module attributes, closures, globals, partials)
or named (``generators=``), registered with every graph before its capture begins, and
left by capture exactly as they were; ``verify()`` runs graph and eager from the same
generator states and leaves them where eager would; RNG capture errors get an RNG hint,
not the host-sync one. Autocast: the lifecycle runs with autocast's cache off, the graphs'
policy is recorded, and the eager paths run under it. The same on real CUDA graphs:
``tests/gpu/test_semantics_gpu.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.capture import sync_related
from graphguard.errors import ConfigError, DivergenceError, GraphCaptureError
from graphguard.phase import Phase
from graphguard.rng import rng_cause, step_generators

SIZES = (1, 2, 4, 8)
D = 16


def build(fn: Any, backend: RecordingBackend | None = None, **kw: Any) -> gg.GraphRunner:
    return gg.GraphRunner(
        fn,
        (torch.zeros(1, D),),
        sizes=SIZES,
        backend=backend or RecordingBackend(),
        progress=False,
        **kw,
    )


class Sampler(torch.nn.Module):
    """Gumbel-max sampling from its own generator (per-request seeds, as engines do)."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        self.head = torch.nn.Linear(D, 32)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        u = torch.rand(logits.shape, generator=self.gen).clamp_min(1e-9)
        noise = -torch.log(-torch.log(u))
        return (logits + noise).argmax(-1), noise


def registered(backend: RecordingBackend) -> dict[Any, list[torch.Generator]]:
    out: dict[Any, list[torch.Generator]] = {}
    for e in backend.events:
        if e[0] == "register_generator":
            out.setdefault(e[1], []).append(e[2])
    return out


def test_a_module_generator_is_registered_with_every_graph_before_its_capture_begins() -> None:
    m = Sampler()
    b = RecordingBackend()
    r = build(m, b)
    report = r.capture()
    regs = registered(b)
    assert sorted(regs) == sorted(SIZES)
    for size, gens in regs.items():
        assert [g is m.gen for g in gens] == [True], size  # the default one: torch's job
        i_reg = max(i for i, e in enumerate(b.events) if e[:2] == ("register_generator", size))
        assert b.events[i_reg + 1] == ("capture_begin", size)
    assert report.generators == ["default", "gen"]


def test_generators_are_found_in_closures_globals_and_partials() -> None:
    g_closure = torch.Generator().manual_seed(1)
    g_partial = torch.Generator().manual_seed(2)

    def closure_step(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=g_closure)

    def partial_step(x: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=generator)

    dev = torch.device("cpu")
    names = dict((n, g) for n, g in step_generators(closure_step, (), dev))
    assert names["g_closure"] is g_closure
    names = dict(step_generators(functools.partial(partial_step, generator=g_partial), (), dev))
    assert names["generator"] is g_partial
    names = dict(step_generators(global_step, (), dev))
    assert names["GLOBAL_GEN"] is GLOBAL_GEN


GLOBAL_GEN = torch.Generator().manual_seed(3)


def global_step(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(x.shape, generator=GLOBAL_GEN)


class Hidden(torch.nn.Module):
    """Keeps its generator under a private name, where the walker does not look."""

    def __init__(self) -> None:
        super().__init__()
        self._g = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=self._g)


def test_generators_option_registers_a_generator_the_walker_cannot_see() -> None:
    m = Hidden()
    b = RecordingBackend()
    r = build(m, b)
    r.capture()
    assert not any(g is m._g for gens in registered(b).values() for g in gens)

    b2 = RecordingBackend()
    r2 = build(m, b2, options=gg.CaptureOptions(generators=[m._g]))
    report = r2.capture()
    assert all(any(g is m._g for g in gens) for gens in registered(b2).values())
    assert report.generators == ["default", "generators[0]"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (torch.Generator(), "list of torch.Generator"),
        ([torch.Generator(), 5], "generators[1] is int"),
        ("gen", "list of torch.Generator"),
    ],
)
def test_bad_generators_option_is_a_config_error_naming_it(value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=r"generators") as info:
        build(Sampler(), options=gg.CaptureOptions(generators=value))
    assert says in str(info.value)


def test_capture_leaves_every_generator_as_it_found_it_and_replays_draw_like_eager() -> None:
    m = Sampler(seed=11)
    torch.manual_seed(123)
    own_before = m.gen.get_state()
    default_before = torch.default_generator.get_state()
    r = build(m, options=gg.CaptureOptions(warmup_iters=2))
    r.capture()  # 4 sizes x (2 warmups + 1 capture) draws, all given back
    assert torch.equal(m.gen.get_state(), own_before)
    assert torch.equal(torch.default_generator.get_state(), default_before)

    # Captured sizes only: a CPU generator's draws depend on the element count, so a
    # padded replay would draw more than eager (CUDA philox offsets do not; GPU test).
    batches = [SIZES[i % len(SIZES)] for i in range(50)]
    xs = [
        torch.randn(n, D, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(batches)
    ]
    graph = [tuple(t.clone() for t in r(x)) for x in xs]
    twin = Sampler(seed=11)
    twin.load_state_dict(m.state_dict())
    eager = [twin(x) for x in xs]
    for i, ((tok, noise), (tok_e, noise_e)) in enumerate(zip(graph, eager)):
        assert torch.equal(noise, noise_e), i
        assert torch.equal(tok, tok_e), i
    assert len({float(noise[0, 0]) for _, noise in graph}) == len(graph)  # fresh each call
    assert torch.equal(m.gen.get_state(), twin.gen.get_state())


class Dropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), p=0.5, training=True)


@torch.inference_mode()
def test_verify_runs_a_dropout_step_from_the_same_default_generator_state() -> None:
    m = Dropout()
    r = build(m)
    r.capture()
    start = torch.default_generator.get_state()
    report = r.verify()
    assert report.ok and [c.size for c in report.sizes] == list(SIZES)
    after = torch.default_generator.get_state()
    # Where eager leaves it: one eager call per input set, two sets per verified size
    # (the second one row shorter where that still pads to the size); replays consume nothing.
    torch.default_generator.set_state(start)
    for i, n in enumerate(SIZES):
        m(torch.zeros(n, D))
        m(torch.zeros(n - 1 if n > 1 and (i == 0 or n - 1 > SIZES[i - 1]) else n, D))
    assert torch.equal(torch.default_generator.get_state(), after)


def test_verify_of_an_own_generator_step_passes_and_a_generator_it_cannot_see_diverges() -> None:
    m = Sampler()
    r = build(m)
    r.capture()
    assert r.verify().ok

    hidden = Hidden()
    blind = build(hidden)
    blind.capture()
    with pytest.raises(DivergenceError, match=r"generators=\[g\]"):
        blind.verify()
    told = build(hidden, options=gg.CaptureOptions(generators=[hidden._g]))
    told.capture()
    assert told.verify().ok


# Text torch raises inside a capture (CUDAGeneratorImpl.cpp / CUDAGraphsUtils.cuh).
RESEED = (
    "Cannot call CUDAGeneratorImpl::set_current_seed during CUDA graph capture. If you "
    "need this call to be captured, please file an issue. Current cudaStreamCaptureStatus: "
    "cudaStreamCaptureStatusActive"
)
UNREGISTERED = "Attempt to increase offset for a CUDA generator not in capture mode."


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        (RESEED, "Seed outside the step"),
        (UNREGISTERED, "generators=[g]"),
        # graphguard's own check at the warmups (torch 2.11 lets an equal reseed pass).
        ("GraphRunner(s) (warmup at size 8): the step reseeded or rewound generator 'gen'", "Seed"),
    ],
    ids=["torch-reseed", "torch-unregistered", "graphguard-reseed"],
)
def test_rng_capture_errors_name_the_rng_cause_not_a_host_sync(text: str, fix: str) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        if gg.is_capturing():
            raise RuntimeError(text)  # what torch raises at this point on a GPU
        return x * 2

    r = build(step)
    with pytest.raises(GraphCaptureError) as info:
        r.capture()
    msg = str(info.value)
    assert "Cause: random numbers" in msg and fix in msg
    assert "must not synchronize the host" not in msg
    assert not sync_related(RuntimeError(text))
    assert rng_cause(RuntimeError("cudaErrorStreamCaptureInvalidated")) is None
    assert sync_related(RuntimeError("cudaErrorStreamCaptureInvalidated"))


# ----------------------------------------------------------------------------- autocast


class Lin(torch.nn.Module):
    """Records, per call, the phase and the autograd node of its weight's autocast cast:
    the same node on two calls means the second found the first's cast in the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(D, D)
        self.casts: list[tuple[Phase, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if out.grad_fn is not None:
            self.casts.append((gg.phase.current_phase(), weight_cast(out, self.fc.weight)))
        return out


def weight_cast(out: torch.Tensor, weight: torch.Tensor) -> Any:
    """The ToCopyBackward node that cast ``weight`` on the way to ``out``."""
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        for nxt, _ in node.next_functions:
            if (
                "ToCopy" in type(node).__name__
                and type(nxt).__name__ == "AccumulateGrad"
                and nxt.variable is weight
            ):
                return node
        stack.extend(n for n, _ in node.next_functions)
    raise AssertionError("no cast of the weight: autocast did not run")


def test_every_capture_records_its_own_weight_casts_under_an_ambient_autocast() -> None:
    m = Lin()
    x = torch.randn(3, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
        m(x)
        caller = m.casts[-1][1]
        assert m.casts[0][1] is caller  # the cache is on: the caller's calls share a cast
        r = build(m, options=gg.CaptureOptions(warmup_iters=2))
        r.capture()
        captures = [n for p, n in m.casts if p is Phase.CAPTURE]
        warmups = [n for p, n in m.casts if p is Phase.WARMUP]
        # Two warmups per size and the output-layout probe's two forwards (the two largest
        # sizes), the probe's at the second largest standing for its first warmup (the
        # largest's first is watched for undeclared writes: no state= here).
        assert len(captures) == len(SIZES) and len(warmups) == 2 * len(SIZES) + 1
        # No capture found a cached cast (the caller's, a warmup's or an earlier capture's).
        assert len({id(n) for n in captures}) == len(SIZES)
        assert not {id(n) for n in captures} & {id(n) for n in [caller, *warmups]}
        m.casts.clear()
        m(x)
        assert m.casts[-1][1] not in captures  # and none outlives its capture
        assert torch.is_autocast_cache_enabled()  # the caller's flag is untouched


@torch.inference_mode()
def test_capture_under_ambient_autocast_keeps_the_policy_for_replay_and_eager_paths() -> None:
    m = Lin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = build(m)
        report = r.capture()
        assert report.autocast == "cpu bfloat16"
        x = torch.randn(4, D)  # a captured size: eager runs the graph's GEMM, bitwise
        inside = r(x).clone()
        ref = m(x)
    assert inside.dtype == torch.bfloat16 and torch.equal(inside, ref)
    # Outside the block: the graph keeps bf16, and so do the eager paths.
    assert r(x).dtype == torch.bfloat16
    big = torch.randn(12, D)  # above the ladder: eager, under the captured policy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_big = m(big)
    out_big = r(big)  # the runner's eager path at the same 12 rows: bitwise
    assert torch.equal(out_big, ref_big)
    assert r.verify().ok


@torch.inference_mode()
def test_runner_captured_without_autocast_stays_fp32_inside_a_callers_autocast() -> None:
    m = Lin()
    r = build(m)
    assert r.capture().autocast == "off"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert r(torch.randn(3, D)).dtype == torch.float32
        assert r(torch.randn(12, D)).dtype == torch.float32  # eager fallback too
        assert r.verify().ok


@torch.inference_mode()
def test_autocast_inside_the_step_keeps_working() -> None:
    m = Lin()

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    r = build(step)
    r.capture()
    x = torch.randn(8, D)  # a captured size: eager runs the graph's GEMM, bitwise
    out = r(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, step(x))
    assert r.verify().ok
