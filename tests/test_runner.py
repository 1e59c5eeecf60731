"""The runner and its lifecycle, through the CPU RecordingBackend (no GPU needed)."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import NamedTuple

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.backend import RecordingBackend
from graphguard.errors import ConfigError, GraphCaptureError, GraphGuardError, InputMismatchError
from graphguard.ladder.full import _unowned
from graphguard.phase import Phase

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def make(fn=None, *, sizes=(1, 2, 4, 8), backend=None, **kw):
    backend = backend or RecordingBackend()

    def default(x, idx):
        return x @ W + idx[:, None].to(x.dtype)

    fn = fn or default
    kw.setdefault("fill_values", (0.0, 5))
    kw.setdefault("progress", False)
    r = gg.GraphRunner(
        fn,
        (torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)),
        sizes=sizes,
        backend=backend,
        **kw,
    )
    return r, backend


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


def recording_fn(backend):
    def fn(x, idx):
        backend.events.append(("forward", gg.phase.current_phase(), x.shape[0]))
        return x @ W + idx[:, None].to(x.dtype)

    return fn


# --------------------------------------------------------------------------- lifecycle


def test_lifecycle_order_for_every_size_largest_first_with_hooks():
    be = RecordingBackend()
    hooks = []
    r, _ = make(
        recording_fn(be),
        backend=be,
        before_capture=[lambda sizes: be.events.append(("before_capture", sizes))],
        options=gg.CaptureOptions(
            after_capture=[lambda sizes: be.events.append(("after_capture", sizes))]
        ),
    )
    del hooks
    r.capture()
    ev = be.events
    assert ev[0] == ("before_capture", (8, 4, 2, 1))
    # The output-layout probe (the last hook): uncaptured forwards at the two largest sizes,
    # each followed by a synchronize like every warmup; then the hooks' own synchronize.
    assert ev[1:6] == [
        ("forward", Phase.WARMUP, 8),
        ("synchronize",),
        ("forward", Phase.WARMUP, 4),
        ("synchronize",),
        ("synchronize",),
    ]
    expected = []
    for s in (8, 4, 2, 1):
        # The probe's forward at 4 was its warmup (a synchronize stands in for it); 8's
        # first warmup is the one watched for undeclared writes (no state=), so it runs.
        warmup = [] if s == 4 else [("forward", Phase.WARMUP, s)]
        expected += [
            *warmup,
            ("synchronize",),
            ("capture_begin", s),
            ("forward", Phase.CAPTURE, s),
            ("capture_end", s),
        ]
    assert ev[6:-1] == expected
    assert [s.prewarmed for s in r.report.sizes] == [False, True, False, False]
    assert ev[-1] == ("after_capture", (8, 4, 2, 1))


def test_each_of_several_warmup_forwards_is_followed_by_a_synchronize():
    be = RecordingBackend()
    r, _ = make(recording_fn(be), backend=be, sizes=(2,), options=gg.CaptureOptions(warmup_iters=3))
    r.capture()
    # The layout probe first (sizes 2 and 1, each synchronized, then the hooks'
    # synchronize), then the warmups: no uncaptured forward without its synchronize.
    assert [e[0] for e in be.events] == ["forward", "synchronize"] * 2 + ["synchronize"] + [
        "forward",
        "synchronize",
    ] * 3 + [
        "capture_begin",
        "forward",
        "capture_end",
    ]


def test_replay_path_records_no_synchronize():
    be = RecordingBackend()
    r, _ = make(backend=be)
    r.capture()
    start = len(be.events)
    for n in (8, 1, 3, 8, 2, 5, 9, 1):
        r(*batch(n))
    after = be.events[start:]
    assert ("synchronize",) not in after
    assert [e for e in after if e[0] == "replay"] == [("replay", s) for s in (8, 1, 4, 8, 2, 8, 1)]


def test_phase_is_serving_after_capture():
    r, _ = make()
    r.capture()
    assert gg.phase.current_phase() is Phase.SERVING


def test_gc_is_paused_during_the_capture_loop_and_restored_after(monkeypatch):
    seen = []
    collects = []

    def fn(x, idx):
        seen.append(gc.isenabled())
        return x + 1

    assert gc.isenabled()
    r, _ = make(fn, sizes=(2,))
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(a) or real_collect(*a))
    r.capture()
    loop = seen[2:]  # after the layout probe's two forwards, which run with the hooks
    assert loop and not any(loop)  # no collection can run inside the loop
    assert collects == []  # and no full collection before it (tens of ms in a big process)
    assert gc.isenabled()


def test_gc_stays_disabled_after_capture_when_the_caller_disabled_it():
    r, _ = make(lambda x, idx: x + 1, sizes=(2,))
    gc.disable()
    try:
        r.capture()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlap_is_off_during_warmups_and_on_during_capture():
    seen = []

    def fn(x, idx):
        seen.append(
            (gg.phase.current_phase(), gg.overlap_allowed(), gg.phase.in_graph_preparation())
        )
        return x * 2

    r, _ = make(fn, sizes=(4,), before_capture=[lambda s: fn(torch.zeros(1, 6), None)])
    r.capture()
    assert seen == [
        (Phase.WARMUP, False, True),  # before_capture hook
        (Phase.WARMUP, False, True),  # the layout probe at size 4
        (Phase.WARMUP, False, True),  # and at size 3
        (Phase.WARMUP, False, True),  # warmup forward
        (Phase.CAPTURE, True, True),  # capture forward
    ]


# ------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_replay_equals_eager_at_every_batch_size(n):
    r, _ = make()
    r.capture()
    x, idx = batch(n)
    out = r(x, idx)
    assert out.shape == (n, 6)
    torch.testing.assert_close(out, x @ W + idx[:, None].float())


def test_padded_rows_hold_fill_values_not_stale_rows_of_a_larger_batch():
    r, _ = make()
    r.capture()
    r(*batch(8, seed=3))
    r(*batch(3, seed=4))
    x_buf, idx_buf = r.static.buffers
    assert torch.all(x_buf[3:] == 0.0)
    assert torch.all(idx_buf[3:] == 5)


def test_padded_rows_are_refilled_every_call_when_the_callable_writes_its_inputs():
    seen_tails = []

    def fn(x, idx):
        seen_tails.append(idx.clone())
        idx.add_(1)  # in-place write to an input: padded rows drift each replay
        return x * 1

    r, _be = make(fn, sizes=(4,))
    r.capture()
    seen_tails.clear()
    for _ in range(3):
        r(*batch(2))
    # every replay saw the padded rows at the fill value 5, never 6, 7, ...
    assert [t[2:].tolist() for t in seen_tails] == [[5, 5]] * 3


def test_above_the_largest_size_runs_eagerly_and_logs_once(caplog):
    r, be = make()
    r.capture()
    start = len(be.events)
    with caplog.at_level(logging.INFO, logger="graphguard"):
        for _ in range(3):
            x, idx = batch(11)
            out = r(x, idx)
            torch.testing.assert_close(out, x @ W + idx[:, None].float())
    assert [e for e in be.events[start:] if e[0] == "replay"] == []
    msgs = [m for m in caplog.messages if "batch size 11 runs eagerly" in m]
    assert len(msgs) == 1 and "largest size of the ladder, 8" in msgs[0]


def test_mode_none_runs_everything_eagerly_through_the_same_api():
    be = RecordingBackend()
    r, _ = make(recording_fn(be), backend=be, mode="none")
    r.capture()
    x, idx = batch(3)
    torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())
    assert [e[0] for e in be.events] == ["forward"]


def test_outputs_are_views_overwritten_by_the_next_call():
    r, _ = make()
    r.capture()
    x1, i1 = batch(4, seed=1)
    first = r(x1, i1)
    snapshot = first.clone()
    r(*batch(4, seed=2))
    assert not torch.equal(first, snapshot)


def test_copy_outputs_returns_owned_tensors():
    r, _ = make(options=gg.CaptureOptions(copy_outputs=True))
    r.capture()
    x1, i1 = batch(4, seed=1)
    first = r(x1, i1)
    snapshot = first.clone()
    r(*batch(4, seed=2))
    assert torch.equal(first, snapshot)


def test_each_size_returns_its_own_graphs_outputs_without_a_copy_out():
    # No copy into the largest graph's outputs: each size hands out views of its own
    # graph's outputs (on CUDA non-owning views whose blocks the next capture reused, so
    # the pool stays the largest graph's alone: tests/gpu/test_pool_gpu.py).
    r, _ = make()
    r.capture()
    for n, size in ((8, 8), (2, 2), (3, 4), (1, 1)):
        x, idx = batch(n)
        out = r(x, idx)
        assert out.shape[0] == n
        assert out.data_ptr() == r.graph_outputs[size][0].data_ptr()
        torch.testing.assert_close(out, x @ W + idx[:, None].float())
    assert len({leaves[0].data_ptr() for leaves in r.graph_outputs.values()}) == 4


def test_unowned_is_a_no_op_off_cuda():
    t = torch.ones(3)
    assert _unowned(t) is t and _unowned(3) == 3


def test_without_sharing_each_size_keeps_its_own_outputs():
    r, _ = make(share_outputs=False)
    r.capture()
    ptrs = {r(*batch(n)).data_ptr() for n in (8, 4, 2)}
    assert len(ptrs) == 3
    x, idx = batch(3)
    torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())


class Pair(NamedTuple):
    logits: torch.Tensor
    total: torch.Tensor


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    scale: torch.Tensor


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "dict", "dataclass"])
def test_nested_outputs_are_supported(kind):
    scale = torch.tensor(2.0)

    def fn(x, idx):
        y = x @ W
        s = scale * 1
        return {
            "tuple": lambda: (y, (s, y + 1)),
            "namedtuple": lambda: Pair(y, s),
            "dict": lambda: {"logits": y, "scale": s},
            "dataclass": lambda: Out(y, s),
        }[kind]()

    r, _ = make(fn)
    r.capture()
    x, idx = batch(3)
    out = r(x, idx)
    ref = fn(x, idx)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b)
    assert type(out) is type(ref)


def test_dict_outputs_are_fresh_containers_each_call():
    r, _ = make(lambda x, idx: {"y": x * 2})
    r.capture()
    a = r(*batch(2))
    a["extra"] = 1
    b = r(*batch(2))
    assert "extra" not in b


# ------------------------------------------------------------------------- validation


def test_input_validation_lists_every_mismatch():
    r, _ = make()
    r.capture()
    with pytest.raises(InputMismatchError) as ei:
        r(torch.zeros(3, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.int32))
    msg = str(ei.value)
    assert "input[0]: expected dtype torch.float32, got torch.float64" in msg
    assert "input[0]: expected shape torch.float32 [B, 6] on cpu, got (3, 5)" in msg
    assert "input[1]: expected dtype torch.int64, got torch.int32" in msg
    assert "input[1]: batch size 2 differs from input[0]'s batch size 3" in msg


def test_validation_names_inputs_and_counts():
    r, _ = make(names=("hidden", "slots"))
    r.capture()
    with pytest.raises(InputMismatchError, match=r"expected 2 inputs \(hidden, slots\), got 1"):
        r(torch.zeros(2, 6))
    with pytest.raises(InputMismatchError, match="slots: expected a tensor"):
        r(torch.zeros(2, 6), [1, 2])
    with pytest.raises(InputMismatchError, match="batch size is 0"):
        r(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))


def test_calling_before_capture_is_an_error():
    r, _ = make()
    with pytest.raises(GraphGuardError, match=r"before capture\(\)"):
        r(*batch(2))


def test_batch_dim_other_than_zero():
    def fn(x):
        return x.transpose(0, 1) * 3

    r = gg.GraphRunner(
        fn,
        (torch.zeros(6, 2),),
        sizes=(2, 4),
        backend=RecordingBackend(),
        progress=False,
        fill_values=-1.0,
        options=gg.CaptureOptions(batch_dims=1),
    )
    r.capture()
    x = torch.randn(6, 3)
    torch.testing.assert_close(r(x), fn(x))
    assert torch.all(r.static.buffers[0][:, 3:] == -1.0)


def test_cuda_graphs_on_cpu_inputs_are_a_config_error():
    r = gg.GraphRunner(lambda x: x, (torch.zeros(2),), sizes=(2,), progress=False)
    with pytest.raises(ConfigError, match="mode='none'"):
        r.capture()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"warmup_iters": -1}, "warmup_iters"),
        ({"on_capture_error": "ignore"}, "on_capture_error"),
        ({"capture_error_mode": "loose"}, "capture_error_mode"),
        ({"fill_values": (1, 2, 3)}, "fill_values"),
        ({"mode": "sometimes"}, "unknown mode"),
        ({"mode": "piecewise"}, "graphguard.piecewise"),
        ({"sizes": [0, 2]}, "entry 0 is 0"),
    ],
)
def test_bad_configuration_is_rejected_up_front(kw, match):
    with pytest.raises(ConfigError, match=match):
        make(**kw)


# --------------------------------------------------------------------- capture errors


def test_failed_capture_raises_names_the_size_and_keeps_larger_sizes():
    be = RecordingBackend()
    be.fail_on = {2}
    r, _ = make(backend=be)
    with pytest.raises(GraphCaptureError) as ei:
        r.capture()
    assert ei.value.size == 2
    assert "capturing size 2 failed" in str(ei.value)
    assert "emulated capture failure at 2" in str(ei.value)
    assert r.captured_sizes == (4, 8)
    assert ("capture_begin", 1) not in be.events  # stopped at the failure
    for n in (1, 2, 3, 8):
        x, idx = batch(n)
        torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())
    assert r.padded_size(1) == 4


def test_skip_mode_captures_the_remaining_sizes():
    be = RecordingBackend()
    be.fail_on = {4}
    r, _ = make(backend=be, options=gg.CaptureOptions(on_capture_error="skip"))
    report = r.capture()
    assert r.captured_sizes == (1, 2, 8)
    assert report.failed == [4] and report.captured == [1, 2, 8]
    assert "1 failed (sizes [4])" in report.summary()
    assert r.padded_size(3) == 8
    x, idx = batch(3)
    torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())


def test_callable_raising_during_capture_is_a_capture_error():
    def fn(x, idx):
        if gg.is_capturing() and x.shape[0] == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    r, be = make(fn, options=gg.CaptureOptions(on_capture_error="skip"))
    r.capture()
    assert ("capture_abort", 4) in be.events
    assert 4 not in r.captured_sizes


def test_output_structure_changing_with_size_fails_that_size():
    def fn(x, idx):
        return (x,) if x.shape[0] == 8 else (x, x)

    r, _ = make(fn, options=gg.CaptureOptions(on_capture_error="skip"))
    report = r.capture()
    assert report.captured == [8]
    assert "output structure" in (report.sizes[1].error or "")


def test_capture_twice_needs_recapture_with_a_reason():
    r, _ = make()
    r.capture()
    with pytest.raises(GraphGuardError, match="recapture"):
        r.capture()
    with pytest.raises(ConfigError, match="reason"):
        r.recapture(reason="")
    r.recapture(reason="weights reloaded")
    x, idx = batch(5)
    torch.testing.assert_close(r(x, idx), x @ W + idx[:, None].float())


def test_report_has_data_table_and_summary():
    r, _ = make()
    report = r.capture()
    d = report.to_dict()
    assert d["captured"] == [1, 2, 4, 8]
    assert [s["size"] for s in d["sizes"]] == [8, 4, 2, 1]
    assert d["summary"].startswith("captured 4 graphs in ")
    assert d["summary"].endswith(" GiB")
    assert report.table().splitlines()[0].split()[:2] == ["size", "warmup"]
    assert len(report.table().splitlines()) == 6


def test_progress_bar_shows_while_capturing(capsys):
    r, _ = make(progress=True)
    r.capture()
    err = capsys.readouterr().err
    assert "capturing GraphRunner" in err


def test_workspaces_are_locked_after_capture():
    ws = gg.Workspace("scratch", "cpu")
    r, _ = make(workspaces=[ws])
    assert not ws.locked
    report = r.capture()
    assert ws.locked
    assert report.arenas[0]["name"] == "scratch"


def test_phase_tripwire_outside_capture_window():
    with pytest.raises(gg.errors.CaptureTripwireError):
        phase.check_capture_allowed("lazy capture")


def test_zero_copy_path_writes_static_rows_and_replays():
    r, be = make()
    r.capture()
    x, idx = batch(3)
    views = r.static_inputs(3)
    assert [v.shape[0] for v in views] == [3, 3]
    views[0].copy_(x)
    views[1].copy_(idx)
    out = r.replay(3)
    torch.testing.assert_close(out, x @ W + idx[:, None].float())
    assert be.events[-1] == ("replay", 4)
    r(*batch(8))
    r.static_inputs(2)[0].copy_(x[:2])
    r.static_inputs(2)[1].copy_(idx[:2])
    r.replay(2)
    assert torch.all(r.static.buffers[1][2:] == 5)  # refilled after the shrink
    with pytest.raises(GraphGuardError, match="no graph for a batch of 9"):
        r.replay(9)
    with pytest.raises(GraphGuardError, match="no graph for a batch of 0"):
        r.static_inputs(0)


def test_static_buffers_track_input_writes_even_when_built_under_inference_mode():
    seen_tails = []

    def fn(x, idx):
        seen_tails.append(idx.clone())
        idx.add_(1)
        return x * 1

    with torch.inference_mode():
        r, _ = make(fn, sizes=(4,))
        r.capture()
        assert not r.static.buffers[0].is_inference()
        seen_tails.clear()
        for _ in range(2):
            r(*batch(2))
    assert [t[2:].tolist() for t in seen_tails] == [[5, 5]] * 2
