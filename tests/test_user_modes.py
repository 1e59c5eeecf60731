"""``gg.build_dispatcher`` on a user's own model, on the CPU: modes, validation, split typos.

The model, its custom attention op and the batch generators are those of
``tests/gpu/test_user_modes_gpu.py`` (one definition); here graphs are emulated by
``RecordingBackend`` at a smaller scale, so CI covers the plumbing: the plan, both
runners, padding, the split, one compile for every size, the table. The recompile test
uses a step that ``.reshape``\\ s a fused-qkv slice, the case that makes dynamo
specialize the token count on 1.
"""

from __future__ import annotations

import logging

import pytest
import torch

import graphguard as gg
from tests.gpu.test_user_modes_gpu import (
    Cfg,
    alternating_batches,
    check_run,
    check_split_table,
    piecewise_batches,
)

CPU = torch.device("cpu")
CFG = Cfg(vocab=64, dim=32, heads=2, layers=2, slots=9, context=32)
MAX_TOKENS = 16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -------------------------------------------------------------------- every mode


def test_piecewise_over_token_count_transitions_equals_eager():
    ran, d, _ = check_run(
        "piecewise",
        piecewise_batches(24, MAX_TOKENS),
        cfg=CFG,
        device=CPU,
        max_tokens=MAX_TOKENS,
        backend_factory=gg.RecordingBackend,
    )
    assert ran["mixed:piecewise"] == 24, ran
    check_split_table(d, CFG.layers)
    assert d.full is None and isinstance(d.piecewise, gg.PiecewiseRunner)


def test_full_and_piecewise_alternating_decode_and_mixed_equals_eager():
    ran, d, _ = check_run(
        "full_and_piecewise",
        alternating_batches(16, MAX_TOKENS, CFG.scratch),
        cfg=CFG,
        device=CPU,
        max_tokens=MAX_TOKENS,
        backend_factory=gg.RecordingBackend,
    )
    assert ran["decode:full"] == 8 and ran["mixed:piecewise"] == 8, ran
    check_split_table(d, CFG.layers)
    assert isinstance(d.full, gg.GraphRunner)
    table = d.table()
    assert "full: 5/5 sizes captured" in table and "piecewise: 5/5 sizes captured" in table


def test_full_mode_runs_decode_on_full_graphs_and_mixed_eagerly():
    ran, d, _ = check_run(
        "full",
        alternating_batches(10, MAX_TOKENS, CFG.scratch),
        cfg=CFG,
        device=CPU,
        max_tokens=MAX_TOKENS,
        backend_factory=gg.RecordingBackend,
    )
    assert ran["decode:full"] == 5 and ran["mixed:none"] == 5, ran
    assert d.piecewise is None


# ------------------------------------------------------------- recompile warning


@torch.library.custom_op("usermodel_cpu::mix", mutates_args=())
def _mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.tanh(q * k) + v


@_mix.register_fake
def _(q, k, v):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


W = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))


def reshape_step(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    q, k, v = (x @ W).split(8, dim=-1)
    q = q.reshape(t, 2, 4)  # a reshape of a non-contiguous slice: specializes t on 1
    a = torch.ops.usermodel_cpu.mix(q, k.view(t, 2, 4), v.view(t, 2, 4))
    return a.view(t, -1)


def view_step(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    q, k, v = (x @ W).split(8, dim=-1)
    q = q.view(t, 2, 4)
    a = torch.ops.usermodel_cpu.mix(q, k.view(t, 2, 4), v.view(t, 2, 4))
    return a.view(t, -1)


def _piecewise(step):
    return gg.build_dispatcher(
        step,
        (torch.zeros(1, 8),),
        mode="piecewise",
        split_ops="usermodel_cpu::mix",
        max_tokens=8,
        backend_factory=gg.RecordingBackend,
        progress=False,
    )


def test_reshape_on_a_qkv_slice_recompiles_and_warns_once_with_the_line_and_the_fix(caplog):
    d = _piecewise(reshape_step)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        reports = d.capture()
    warned = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert len(warned) == 1, warned
    msg = warned[0]
    assert "x.size()[0] != 1" in msg  # the guard that failed
    assert "q = q.reshape(t, 2, 4)" in msg  # the line that added it
    assert "`.view(...)`" in msg  # the fix
    report = reports["piecewise"]
    assert report.compiles == 2 and len(report.recompiles) == 1
    assert "2 compiles (1 extra" in report.summary()
    assert "2 compiles (1 recompile" in d.table()
    x = torch.randn(1, 8)
    torch.testing.assert_close(d(gg.BatchKey.mixed(1), x), view_step(x))


def test_view_on_a_qkv_slice_compiles_once_for_every_size(caplog):
    d = _piecewise(view_step)
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        reports = d.capture()
    assert not [r for r in caplog.records if "recompiled" in r.getMessage()]
    assert reports["piecewise"].compiles == 1 and reports["piecewise"].recompiles == []
    assert "split at usermodel_cpu::mix x1 calls, 1 compile" in d.table()
    for n in (1, 3, 8):
        x = torch.randn(n, 8)
        torch.testing.assert_close(d(gg.BatchKey.mixed(n), x), view_step(x))


# -------------------------------------------------------------------- split typo


def test_a_split_op_typo_is_an_error_naming_it_and_the_ops_that_ran():
    d = gg.build_dispatcher(
        view_step,
        (torch.zeros(1, 8),),
        mode="full_and_piecewise",
        split_ops=["usermodel_cpu::mixx"],
        max_tokens=8,
        backend_factory=gg.RecordingBackend,
        progress=False,
    )
    with pytest.raises(gg.errors.ConfigError) as err:
        d.capture()
    msg = str(err.value)
    assert "usermodel_cpu::mixx never ran" in msg
    assert "usermodel_cpu::mix" in msg.split("Ops that did run:")[1]
    assert "namespace" in msg


# ------------------------------------------------------------- builder validation


def _build(**kw):
    args = {
        "mode": "full_and_piecewise",
        "split_ops": ["usermodel_cpu::mix"],
        "max_tokens": 8,
        "backend_factory": gg.RecordingBackend,
        "progress": False,
    }
    args.update(kw)
    example = args.pop("example_inputs", (torch.zeros(1, 8),))
    return gg.build_dispatcher(view_step, example, **args)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"mode": "piecewise", "split_ops": ()}, r"mode PIECEWISE needs split_ops.*mode='full'"),
        (
            {"split_ops": None},
            r"FULL_AND_PIECEWISE needs split_ops:.*split_ops=\['mylib::attention'\]",
        ),
        ({"max_tokens": 2, "query_len": 3}, r"max_tokens=2 is below query_len=3.*Raise max_tokens"),
        ({"max_tokens": 0}, r"max_tokens must be a positive int"),
        ({"max_tokens": True}, r"max_tokens must be a positive int"),
        ({"query_len": 0}, r"query_len must be a positive int \(1 for decode"),
        ({"mode": "pieces"}, r"unknown mode 'pieces'"),
        ({"split_ops": 3}, r"split_ops must be a list of ops.*split_ops=\['mylib::attention'\]"),
        ({"sizes": [1, 2]}, r"does not take sizes=: use full_sizes= and piecewise_sizes="),
        ({"batch_dims": 1}, r"does not take batch_dims=: inputs are one row per token"),
        ({"backend": gg.RecordingBackend()}, r"does not take backend=: pass backend_factory="),
        ({"backend_factory": 5}, r"backend_factory must be a callable"),
        ({"eager": "step"}, r"eager must be a callable"),
        ({"example_inputs": ()}, r"example_inputs must be a non-empty tuple of tensors"),
        (
            {"example_inputs": (torch.zeros(1, 8), torch.zeros(2))},
            r"example_inputs\[1\] has 2 rows but example_inputs\[0\] has 1.*one row per token",
        ),
        ({"example_inputs": (torch.tensor(1.0),)}, r"example_inputs\[0\] is a 0-d tensor"),
        ({"example_inputs": ([1.0],)}, r"example_inputs\[0\] is a list, not a tensor"),
        ({"full_sizes": [3]}, r"full_sizes.*not multiples of query_len=2"),
        ({"piecewise_sizes": [16]}, r"piecewise_sizes.*above max_tokens=8"),
        ({"warmup_itres": 2}, r"did you mean options=graphguard\.CaptureOptions\(warmup_iters="),
    ],
)
def test_builder_validation_names_the_argument_and_the_fix(kw, match):
    if "full_sizes" in kw:
        kw = {**kw, "query_len": 2}
    with pytest.raises(gg.errors.ConfigError, match=match):
        _build(**kw)


def test_split_ops_in_mode_full_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        d = _build(mode="full")
    assert d.piecewise is None and isinstance(d.full, gg.GraphRunner)
    assert any("ignored in mode FULL" in r.getMessage() for r in caplog.records)


def test_builder_passes_runner_options_names_and_fill_values_to_both_runners():
    d = _build(
        name="mystep", fill_values=-1, names=("x",), query_len=2,
        options=gg.CaptureOptions(warmup_iters=2),
    )  # fmt: skip
    assert d.plan.name == "mystep" and d.plan.query_len == 2
    for runner, label in ((d.full, "mystep.full"), (d.piecewise, "mystep.piecewise")):
        assert runner is not None
        assert runner.name == label and runner.options.warmup_iters == 2
        assert runner.options.names == ("x",) and runner.options.fill_values == -1
        assert isinstance(runner.backend, gg.RecordingBackend)
    assert d.full.backend is not d.piecewise.backend  # one backend per runner
    assert tuple(d.full.sizes) == d.plan.full_sizes and all(s % 2 == 0 for s in d.full.sizes)
