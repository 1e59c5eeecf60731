"""torch.cuda.graph's semantics kept on any step (CPU, RecordingBackend): in-place writes
to arguments, output layouts established from two sizes, verify() never green on nothing.

Each case runs with one captured size and with a ladder, and ends with a good call that
equals eager (the caller-visible result: outputs and the arguments the step writes).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, DivergenceError, GraphCaptureError, GraphGuardError
from graphguard.outputs import probe_sizes
from graphguard.piecewise import PiecewiseRunner
from tests.test_distributed import _rows, world1  # noqa: F401 (world1: a fixture)
from tests.test_distributed import _runner as _distributed_runner

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
LADDERS = {"one size": (8,), "ladder": (2, 4, 8)}


def inputs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


def full(fn: Any, sizes: tuple[int, ...] = (2, 4, 8), **kw: Any) -> gg.GraphRunner:
    kw.setdefault("fill_values", (0.0, 5))
    kw.setdefault("progress", False)
    kw.setdefault("backend", RecordingBackend())
    example = (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long))
    return gg.GraphRunner(fn, example, sizes=sizes, **kw)


def same_as_eager(r: Any, fn: Any, n: int, seed: int) -> None:
    """One call through the runner and one eager call on copies: outputs and arguments equal."""
    mine = inputs(n, seed)
    theirs = tuple(x.clone() for x in mine)
    got = r(*mine)
    want = fn(*theirs)
    torch.testing.assert_close(got, want)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- in place


def add_in_place(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    x.add_(1.0)
    return x @ W + idx[:, None].to(x.dtype)


def write_out_arg(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.mul(out, 3, out=out)  # an out= argument, written like an in-place op
    return x * 2


def write_behind_torchs_back(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    x.data.mul_(2.0)  # .data: the version counter of x does not move
    return x + idx[:, None].to(x.dtype)


@pytest.mark.parametrize("sizes", LADDERS.values(), ids=LADDERS.keys())
@pytest.mark.parametrize("fn", [add_in_place, write_out_arg, write_behind_torchs_back])
def test_a_step_that_writes_its_arguments_leaves_them_as_eager_does(fn, sizes):
    # Fill values that the writes change (a .data write of the value already there is
    # invisible to both witnesses; docs/reference.md, "Semantics versus torch.cuda.graph").
    r = full(fn, sizes, fill_values=(1.0, 1))
    r.capture()
    written = [1] if fn is write_out_arg else [0]
    assert r.door.entries[3] is not None and r.door.entries[3].writeback == written
    for step, n in enumerate((3, 8, 1, 5, 2, 8, 3)):
        same_as_eager(r, fn, n, seed=step)


def test_the_dot_data_write_is_one_torch_does_not_count():
    x = torch.zeros(2, 6)
    write_behind_torchs_back(x, torch.zeros(2, dtype=torch.long))
    assert x._version == 0  # so only the contents comparison can see it


@pytest.mark.parametrize("sizes", [(1,), (8,), (2, 4, 8)])
def test_writes_are_seen_without_warmups_too(sizes):
    r = full(add_in_place, sizes, options=gg.CaptureOptions(warmup_iters=0))
    r.capture()
    for step, n in enumerate((1, sizes[-1], 1)):
        same_as_eager(r, add_in_place, n, seed=step)


@torch.inference_mode()
def test_writes_are_seen_and_copied_back_under_inference_mode():
    r = full(add_in_place, (2, 4, 8))
    r.capture()
    for step, n in enumerate((3, 8)):
        same_as_eager(r, add_in_place, n, seed=step)


def test_a_step_that_writes_nothing_pays_nothing():
    r = full(lambda x, idx: x @ W, (2, 4, 8))
    r.capture()
    assert all(e is None or e.writeback == [] for e in r.door.entries)


def test_zero_copy_path_needs_no_write_back_the_static_views_are_the_arguments():
    r = full(add_in_place, (2, 4, 8))
    r.capture()
    x, idx = inputs(3)
    views = r.static_inputs(3)
    views[0].copy_(x)
    views[1].copy_(idx)
    want = add_in_place(x.clone(), idx)
    torch.testing.assert_close(r.replay(3), want)
    torch.testing.assert_close(views[0], x + 1)


def test_a_write_back_into_an_unwritable_tensor_names_the_input():
    r = full(add_in_place, (2, 4, 8))
    r.capture()
    x = torch.randn(1, 6).expand(3, 6)  # eager's x.add_ would fail on it too
    with pytest.raises(GraphGuardError, match=r"writes its input\(s\) \['input\[0\]'\] in place"):
        r(x, torch.zeros(3, dtype=torch.long))
    same_as_eager(r, add_in_place, 3, seed=9)


def test_written_inputs_are_logged_once_by_name(caplog):
    with caplog.at_level(logging.INFO, logger="graphguard"):
        r = full(add_in_place, (2, 4, 8), names=("hidden", "ids"))
        r.capture()
    msgs = [m for m in caplog.messages if "writes its inputs" in m]
    assert len(msgs) == 1 and "['hidden']" in msgs[0] and "copies the written rows back" in msgs[0]


def piecewise(fn: Any, sizes: tuple[int, ...], n_inputs: int = 1) -> PiecewiseRunner:
    example = tuple(torch.zeros(3, 6) for _ in range(n_inputs))
    return PiecewiseRunner(
        fn, example, split_ops=[torch.relu], sizes=sizes, backend=RecordingBackend(), progress=False
    )


@torch.no_grad()
@pytest.mark.parametrize("sizes", LADDERS.values(), ids=LADDERS.keys())
def test_piecewise_copies_written_arguments_back_like_full(sizes):
    def step(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(x)
        return torch.relu(x @ W) @ W

    r = piecewise(step, sizes, n_inputs=2)
    r.capture()
    for n in (3, sizes[-1], 1):
        x, acc = torch.randn(n, 6), torch.randn(n, 6)
        x2, acc2 = x.clone(), acc.clone()
        torch.testing.assert_close(r(x, acc), step(x2, acc2))
        torch.testing.assert_close(acc, acc2)


# --------------------------------------------------------------------------- layouts


def features_by_batch(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return (x @ W).t()  # [features, batch]: the batch is dim 1


def constant_table(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ W, W * 2  # W is [6, 6]: its first dim equals a capture size


@pytest.mark.parametrize("sizes", [(6,), (2, 4, 6), (3, 6)], ids=["one size", "ladder", "two"])
@pytest.mark.parametrize("fn", [features_by_batch, constant_table])
def test_output_layouts_are_established_whatever_the_number_of_sizes(fn, sizes):
    r = full(fn, sizes)
    r.capture()
    for step, n in enumerate((3, sizes[-1], 1, 5)):
        same_as_eager(r, fn, n, seed=step)


def test_probe_sizes_are_two_the_step_is_asked_to_run_or_none():
    assert probe_sizes([1, 2, 4, 8]) == [8, 4]
    assert probe_sizes([8]) == [8, 7] and probe_sizes([2]) == [2, 1]
    assert probe_sizes([1]) == []  # nothing is ever narrowed at a ladder of size 1


def batch_twice(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ W, torch.cat([x, x])  # [2 * batch, 6]: which rows belong to n?


def batch_by_batch(x: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"y": x @ W, "pairs": x @ x.t()}  # [batch, batch]


@pytest.mark.parametrize("sizes", LADDERS.values(), ids=LADDERS.keys())
@pytest.mark.parametrize(
    ("fn", "path", "shapes", "why"),
    [
        (batch_twice, r"output\[1\]", r"\[16, 6\] at batch 8", "dim 0 changes .* not the batch"),
        (batch_by_batch, r"output\['pairs'\]", r"\[8, 8\] at batch 8", r"dims \[0, 1\]"),
    ],
)
def test_an_ambiguous_output_is_refused_at_capture_with_its_path_and_both_shapes(
    fn, path, shapes, why, sizes
):
    r = full(fn, sizes)
    with pytest.raises(GraphCaptureError, match=path) as info:
        r.capture()
    msg = str(info.value)
    assert re.search(shapes, msg) and re.search(why, msg), msg
    assert r.captured_sizes == ()  # nothing served with a guessed layout
    good = full(lambda x, idx: x @ W, sizes)
    good.capture()
    same_as_eager(good, lambda x, idx: x @ W, 3, seed=0)


def test_a_leaf_that_changes_dtype_with_the_batch_is_refused():
    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x.double() if x.shape[0] == 8 else x

    with pytest.raises(GraphCaptureError, match=r"dtype changes with the batch size"):
        full(fn, (4, 8)).capture()


def test_a_step_that_runs_at_one_batch_only_replays_that_batch_and_says_so(caplog):
    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x.view(2, 4, 6).sum(1)  # only a batch of 8 fits

    r = full(fn, (8,))
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        r.capture()
    assert any("could not be established" in m and "batch 7" in m for m in caplog.messages)
    assert r.padded_size(8) == 8 and r.padded_size(3) is None
    same_as_eager(r, fn, 8, seed=0)
    with pytest.raises(RuntimeError, match="shape"):  # like eager: no guessed replay
        r(*inputs(3))


def test_a_probe_forward_that_raises_is_noted_and_the_ladder_settles_the_layout():
    calls: list[int] = []

    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 2:  # the probe's second forward (size 4), once
            raise RuntimeError("transient")
        return (x @ W).t()

    r = full(fn, (2, 4, 8))
    r.capture()
    assert calls[:2] == [8, 4] and r.captured_sizes == (2, 4, 8)
    assert r._store.layout.probe_error == "at batch 4: RuntimeError: transient"
    assert r._store.layout.dims == [1]  # from the warmups at 8 and 4
    same_as_eager(r, fn, 3, seed=0)


@torch.no_grad()
@pytest.mark.parametrize("sizes", LADDERS.values(), ids=LADDERS.keys())
def test_piecewise_uses_the_same_layout_rule(sizes):
    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(x @ W)
        return (h @ W).t(), W + 0 * h.sum()

    r = piecewise(step, sizes)
    r.capture()
    for n in (3, sizes[-1], 1):
        x = torch.randn(n, 6)
        got = r(x)
        assert got[0].shape == (6, n) and got[1].shape == (6, 6)
        torch.testing.assert_close(got, step(x))


@torch.no_grad()
def test_piecewise_refuses_an_ambiguous_output_too():
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(x), x])

    r = piecewise(step, (2, 4, 8))
    with pytest.raises(
        GraphCaptureError,
        match=r"output is float32 \[8, 6\] at batch 4 and float32 \[16, 6\] at batch 8",
    ):
        r.capture()
    assert r.captured_sizes == ()


# --------------------------------------------------------------------------- verify


def test_verify_before_capture_raises_naming_why():
    with pytest.raises(GraphGuardError, match=r"nothing to check.*capture\(\) has not run yet"):
        full(lambda x, idx: x @ W).verify()


def test_verify_after_release_raises():
    r = full(lambda x, idx: x @ W)
    r.capture()
    assert r.verify().ok
    r.release()
    with pytest.raises(GraphGuardError, match=r"nothing to check.*released"):
        r.verify()


def test_verify_when_every_size_failed_under_skip_raises():
    be = RecordingBackend()
    be.fail_on = {2, 4, 8}
    r = full(lambda x, idx: x @ W, backend=be, options=gg.CaptureOptions(on_capture_error="skip"))
    report = r.capture()  # returns normally, every call runs eagerly
    assert report.failed == [2, 4, 8]
    with pytest.raises(GraphGuardError, match=r"every size failed to capture \(\[2, 4, 8\]"):
        r.verify()


def test_verify_of_mode_none_raises():
    r = full(lambda x, idx: x @ W, mode="none")
    r.capture()
    with pytest.raises(GraphGuardError, match="mode 'none'"):
        r.verify()


@pytest.mark.parametrize(("extra", "runs"), [(1, "the size-4 graph"), (7, "eagerly")])
def test_verify_refuses_inputs_of_another_batch_naming_the_size_and_the_batch(extra, runs):
    r = full(lambda x, idx: x @ W)
    r.capture()
    with pytest.raises(
        ConfigError, match=rf"size 2, but make_inputs\(2\) returned a batch of {2 + extra}.*{runs}"
    ):
        r.verify(make_inputs=lambda n: inputs(n + extra))


def test_verify_report_lists_the_batch_and_the_graph_replayed():
    r = full(lambda x, idx: x @ W)
    r.capture()
    report = r.verify(make_inputs=lambda n: inputs(n - 1 if n > 2 else n))
    assert [(c.size, c.batch, c.graph) for c in report.sizes] == [(2, 2, 2), (4, 3, 4), (8, 7, 8)]
    assert "size  batch  graph" in report.table()
    with pytest.raises(ConfigError, match=r"verify\(sizes=\[\]\) checks nothing"):
        r.verify(sizes=[])


def test_verify_compares_the_arguments_a_step_writes():
    r = full(add_in_place)
    r.capture()
    assert r.verify().ok
    for e in r.door.entries:  # a write-back lost: what graphguard did before
        if e is not None:
            e.writeback = []
    with pytest.raises(DivergenceError, match=r"input input\[0\] after the call differs"):
        r.verify()


@pytest.mark.usefixtures("world1")
def test_distributed_runner_verify_raises_on_nothing_and_checks_a_captured_ladder():
    r = _distributed_runner(0, sizes=[1, 2, 4])
    with pytest.raises(GraphGuardError, match="nothing to check"):
        r.verify()
    r.capture()
    report = r.verify(make_inputs=lambda n: (_rows(0, n),))
    assert report.ok and [(c.size, c.batch, c.graph) for c in report.sizes] == [
        (1, 1, 1),
        (2, 2, 2),
        (4, 4, 4),
    ]
    r.release()
    with pytest.raises(GraphGuardError, match="nothing to check"):
        r.verify()


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("m", [4, 16], ids=["padded replay", "above the ladder"])
def test_distributed_pad_path_uses_the_layout_and_copies_written_rows_back(m):
    """on_mismatch="pad": this rank's 3 rows run as a batch of m (another rank's batch)."""
    import torch.distributed as dist

    from graphguard.distributed import DistributedGraphRunner

    def step(x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        y = (x * 2).t().contiguous()  # [features, batch]
        dist.all_reduce(y)
        return y

    r = DistributedGraphRunner(
        step, [torch.zeros(1, 3)], sizes=[1, 2, 4, 8], backend=RecordingBackend(), timeout=10.0
    )
    r.capture()
    x = torch.randn(3, 3)
    x2 = x.clone()
    got = r._padded_call((x,), 3, m)
    torch.testing.assert_close(got, step(x2))
    torch.testing.assert_close(x, x2)
