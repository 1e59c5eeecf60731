"""A declared output layout (``CaptureOptions(output_batch_dims=...)``), on the CPU.

The layout probe runs the step at the two largest sizes to learn which outputs are
batched; a caller that knows declares it, and a lazy stage then runs no forward (issue 41:
the time to the first token), or the largest size's alone when arenas or a compile need
it. Every forward is still checked against the declaration, and a leaf that does not fit
is refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError

SIZES = [1, 2, 4, 8]


class Step(torch.nn.Module):
    """``(x @ w + 1, table)``: a batched output and a constant ``[3, 3]`` table; records
    the batch of each forward run eagerly (a warmup: the CPU emulation's captures and
    replays run the step too)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.register_buffer("table", torch.arange(9.0).view(3, 3))
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if phase.current_phase() is phase.Phase.WARMUP:
            self.batches.append(int(x.shape[0]))
        return x @ self.w + 1, self.table * 1


def runner(step: Step, dims: Any, **kw: Any) -> gg.GraphRunner:
    kw.setdefault("lazy", True)
    return gg.GraphRunner(
        step,
        (torch.zeros(2, 8),),
        sizes=SIZES,
        state=[],
        progress=False,
        backend=gg.RecordingBackend(),
        options=gg.CaptureOptions(output_batch_dims=dims),
        **kw,
    )


def test_a_lazy_stage_with_a_declared_layout_runs_no_forward_and_serves_padded() -> None:
    step = Step()
    r = runner(step, [0, None])
    r.capture()
    assert step.batches == []  # nothing to learn: the first request is the first forward
    x = torch.randn(3, 8)
    for _ in range(3):  # its first call (eager at 4), its capture, a replay
        out, table = r(x)
        torch.testing.assert_close(out, x @ step.w + 1)
        assert torch.equal(table, step.table)
    assert step.batches == [4] and r.captured_sizes == (4,)
    assert r.stats().size(4).replays == 2


def test_one_int_declares_every_tensor_leaf_batched() -> None:
    step = Step()
    step.forward = lambda x: (x @ step.w + 1, x * 2)  # type: ignore[method-assign]
    r = runner(step, 0)
    r.capture()
    x = torch.randn(3, 8)
    for _ in range(2):
        a, b = r(x)
        assert a.shape == (3, 8) and torch.equal(b, x * 2)


def test_the_learned_layout_still_probes_the_two_largest_sizes() -> None:
    step = Step()
    runner(step, None).capture()
    assert step.batches == [8, 4]


@pytest.mark.parametrize(
    ("dims", "needle"),
    [
        (0, r"output\[1\] is float32 \[3, 3\]: its dim 0 is not the batch \([48]\)"),
        ([0], r"gives 1 entries, but the step returns 2 output leaves"),
        ([0, 2], r"output\[1\] is float32 \[3, 3\]: its dim 2 is not the batch"),
    ],
)
def test_a_leaf_that_does_not_fit_the_declaration_is_refused(dims: Any, needle: str) -> None:
    step = Step()
    r = runner(step, dims)
    r.capture()
    with pytest.raises(GraphGuardError, match=needle):
        r(torch.randn(3, 8))  # the first call: the request's own forward fails
    # Up front, every size's warmup fails with the same refusal.
    with pytest.raises(GraphCaptureError, match=needle):
        runner(Step(), dims, lazy=None).capture()


def test_arenas_make_the_stage_run_the_largest_size_alone() -> None:
    step = Step()
    ws = gg.Workspace("scratch", "cpu")

    def with_scratch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (buf,) = ws.get(((int(x.shape[0]), 8), x.dtype))
        buf.zero_()
        return Step.forward(step, x)

    step.forward = with_scratch  # type: ignore[method-assign]
    r = runner(step, [0, None], workspaces=[ws])
    r.capture()
    assert step.batches == [8]  # the arena sized at the largest size before it locks
    x = torch.randn(3, 8)
    for _ in range(2):
        torch.testing.assert_close(r(x)[0], x @ step.w + 1)


@pytest.mark.parametrize("bad", ["0", -1, [], [0, "x"], True, 1.0])
def test_bad_declarations_are_config_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match="output_batch_dims must be"):
        gg.CaptureOptions(output_batch_dims=bad)


def test_it_is_an_option_not_a_runner_keyword() -> None:
    with pytest.raises(ConfigError, match=r"is set through options=graphguard\.CaptureOptions"):
        gg.GraphRunner(Step(), (torch.zeros(2, 8),), output_batch_dims=0)  # type: ignore[call-arg]


def test_graphed_causal_lm_declares_its_logits_and_its_lazy_stage_runs_no_forward() -> None:
    pytest.importorskip("transformers")
    from graphguard.integrations.transformers import GraphedCausalLM
    from tests import hf_families as F

    model = F.model("llama")
    g = GraphedCausalLM(
        model, max_batch=4, max_cache_len=40, backend=gg.RecordingBackend(), progress=False,
        lazy=True,
    )  # fmt: skip
    assert g.runner.options.output_batch_dims == 0
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    try:
        g.capture()
    finally:
        hook.remove()
    assert calls == []
    # Four prompts: the decode graph of size 4 against eager at the same size (no padding,
    # so the tokens are bitwise whatever the CPU's BLAS).
    ids, mask = F.prompts(4, seed=4)
    want = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=5, cache_implementation="static"
    )
    assert torch.equal(g.generate(ids, mask, max_new_tokens=5), want)
    assert g.captured_sizes == (4,)


def test_piecewise_runner_compiles_at_the_stage_with_a_declared_layout() -> None:
    """PIECEWISE compiles at the stage: its largest size's forward still runs there (the
    compile), the rest of the layout probe does not."""
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    lib = torch.library.Library("ggdims", "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    ran: list[int] = []  # the op's eager kernel: every forward that really runs it

    def mix(x: torch.Tensor) -> torch.Tensor:
        ran.append(int(x.shape[0]))
        return x * 2

    lib.impl("mix", mix, "CPU")
    lib.impl("mix", lambda x: torch.empty_like(x), "Meta")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ggdims.mix(x + 1) - 1

    r = gg.PiecewiseRunner(
        fn, (torch.zeros(2, 4),), split_ops=["ggdims::mix"], sizes=[2, 4, 8], lazy=True,
        backend=gg.RecordingBackend(), progress=False,
        options=gg.CaptureOptions(output_batch_dims=0),
    )  # fmt: skip
    r.capture()
    assert r.compile_count == 1 and set(ran) == {8}  # the largest size alone, compiled
    for n in (3, 3, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(r(x), fn(x))
    assert r.captured_sizes == (4,)


def test_the_dispatcher_and_its_runners_take_the_declaration() -> None:
    step = Step()
    d = gg.build_dispatcher(
        step, (torch.zeros(2, 8),), mode="full", max_tokens=16, lazy=True, state=[],
        progress=False, backend_factory=gg.RecordingBackend,
        options=gg.CaptureOptions(output_batch_dims=[0, None]),
    )  # fmt: skip
    d.capture()
    assert step.batches == []
    x = torch.randn(5, 8)
    for _ in range(2):  # its first call, then its capture
        out, table = d(gg.BatchKey.decode(5), x)
        torch.testing.assert_close(out, x @ step.w + 1)
        assert torch.equal(table, step.table)
    assert d.full is not None and d.full.options.output_batch_dims == (0, None)
