"""Every bad input is a graphguard error naming the argument and the fix, or a correct result.

One parametrized matrix: construction options, fill values, call-time inputs, the
zero-copy path, memory estimation, dispatch keys and plans. After every bad call a good
call on the same (captured) runner still equals eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard import streams
from graphguard.backend import RecordingBackend
from graphguard.dispatch import BatchKey, Dispatcher, DispatchPlan
from graphguard.errors import BusyStreamError, ConfigError, GraphGuardError, InputMismatchError

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))


def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x @ W + idx[:, None].to(x.dtype)


def example() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(3, 6), torch.zeros(3, dtype=torch.long)


def build(example_inputs: Any = None, callable_: Any = fn, **kw: Any) -> gg.GraphRunner:
    kw.setdefault("sizes", (1, 2, 4, 8))
    kw.setdefault("backend", RecordingBackend())
    kw.setdefault("progress", False)
    return gg.GraphRunner(callable_, example() if example_inputs is None else example_inputs, **kw)


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 100, (n,), generator=g)


def one_input(dtype: torch.dtype, fill: Any) -> gg.GraphRunner:
    return gg.GraphRunner(
        lambda t: t + 0,
        (torch.zeros(2, 3, dtype=dtype),),
        sizes=(2,),
        fill_values=fill,
        backend=RecordingBackend(),
        progress=False,
    )


def sparse_input() -> gg.GraphRunner:
    return gg.GraphRunner(lambda t: t, (torch.zeros(2, 3).to_sparse(),), sizes=(2,), progress=False)


def key_mismatch(r: gg.GraphRunner) -> Any:
    plan = DispatchPlan("full", max_tokens=8, full_sizes=[1, 2, 4, 8])
    d = Dispatcher(plan, eager=fn, full=r)
    return d(BatchKey.decode(2), *batch(5))


def inplace_writer_without_warmup(r: gg.GraphRunner) -> None:
    """warmup_iters=0 and a callable that writes its inputs: padded rows must not drift."""

    def writer(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return x @ W + idx[:, None].to(x.dtype)

    w = build(callable_=writer, fill_values=(0.0, 5), options=gg.CaptureOptions(warmup_iters=0))
    w.capture()
    for step, n in enumerate((8, 3, 3, 5, 1, 3)):
        x, idx = batch(n, seed=step)
        want = writer(x.clone(), idx)
        torch.testing.assert_close(w(x, idx), want)
        # The padded rows of the largest buffer hold the fill value again after the call
        # refills them (they must never accumulate the writer's +1s).
        assert torch.all(w.static.buffers[0][n:] <= 1.0)


def integral_float_fill_is_accepted(r: gg.GraphRunner) -> None:
    x = one_input(torch.int64, 3.0)
    x.capture()
    torch.testing.assert_close(
        x(torch.ones(1, 3, dtype=torch.long)), torch.ones(1, 3, dtype=torch.long)
    )
    assert int(x.static.buffers[0][1, 0]) == 3


# ---- issue 20 items 6 and 8: flags and declarations that meant something else


class BrokenStream:
    """A watched stream whose query() fails, as a destroyed CUDA stream's does."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: invalid resource handle")


def broken_watched_stream(r: gg.GraphRunner) -> None:
    """busy_streams() and a capture both name the stream; unwatched, capture works again."""
    s = BrokenStream()
    gg.watch_stream(s, "side-rope")
    try:
        with pytest.raises(BusyStreamError, match=r"'side-rope'.*invalid resource handle"):
            streams.busy_streams()
        fresh = build(fill_values=(0.0, 5))
        with pytest.raises(BusyStreamError, match=r"'side-rope'.*unwatch_stream"):
            fresh.capture()
    finally:
        streams.unwatch_stream(s)
    fresh.capture()  # the aborted capture kept nothing and may simply be retried
    x, idx = batch(3)
    torch.testing.assert_close(fresh(x, idx), fn(x, idx))


def released_call(r: gg.GraphRunner) -> None:
    """A released runner says it was released and how to capture again; that works."""
    rel = build(fill_values=(0.0, 5))
    rel.capture()
    rel.release()
    x, idx = batch(3)
    with pytest.raises(GraphGuardError, match=r"after release\(\).*runner\.capture\(\)") as ei:
        rel(x, idx)
    assert "before capture()" not in str(ei.value)
    with pytest.raises(GraphGuardError, match=r"released: call capture\(\) again"):
        rel.replay(2)
    rel.capture()
    torch.testing.assert_close(rel(x, idx), fn(x, idx))


def workspace_then_good(bad: Callable[[gg.Workspace], Any], *, lock: bool = False) -> None:
    """The bad request on an arena, then proof the arena still serves a good one."""
    ws = gg.Workspace("scratch", "cpu")
    (v,) = ws.get(((4, 8), torch.float32))
    if lock:
        ws.lock()
    try:
        bad(ws)
    finally:
        assert ws.nbytes >= 128 and ws.peak_bytes == 128  # nothing grew, nothing counted
        (w,) = ws.get(((4, 8), torch.float32))
        assert w.data_ptr() == v.data_ptr()


def aux_then_good(bad: Callable[[gg.AuxStream], Any]) -> None:
    """The bad fork/keep on an AuxStream, then a good fork on it equals eager."""
    aux = gg.AuxStream("rope", "cpu")
    try:
        bad(aux)
    finally:
        x = torch.randn(3, 6)
        with aux.fork(x) as br:
            y = x @ W
            br.keep(y)
        torch.testing.assert_close(y, x @ W)


def fork_non_tensors(aux: gg.AuxStream) -> None:
    with aux.fork(5, "x"):  # type: ignore[arg-type]
        pass


def keep_non_tensor(aux: gg.AuxStream) -> None:
    with aux.fork() as br:
        br.keep("x")  # type: ignore[arg-type]


def verify_then_good(**kw: Any) -> Callable[[gg.GraphRunner], Any]:
    """verify(**kw) on the captured runner; the runner still verifies clean after."""

    def action(r: gg.GraphRunner) -> None:
        try:
            r.verify(**kw)
        finally:
            assert r.verify(sizes=(s for s in (2, 4))).ok  # a generator is read once

    return action


def sparse_csr(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch: "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        return x.to_sparse_csr()


def nested(layout: torch.layout = torch.strided) -> torch.Tensor:
    with warnings.catch_warnings():  # torch: "nested tensors is in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(6), torch.zeros(6)], layout=layout)


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # torch: quantized tensor creation is deprecated
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.zeros(2, 6), 0.1, 0, torch.quint8)


CACHE = torch.zeros(8, 6)


Case = tuple[Callable[[gg.GraphRunner], Any], type[BaseException] | None, tuple[str, ...]]

CASES: dict[str, Case] = {
    # ---- sizes
    "sizes_int": (lambda r: build(sizes=8), ConfigError, ("sizes must be a list", "sizes=[8]")),
    "sizes_empty": (lambda r: build(sizes=[]), ConfigError, ("empty", "capture_sizes")),
    "sizes_duplicate": (lambda r: build(sizes=[2, 2, 4]), ConfigError, ("duplicates [2]",)),
    "sizes_zero": (lambda r: build(sizes=[0, 2]), ConfigError, ("entry 0 is 0", "positive")),
    "sizes_float": (lambda r: build(sizes=[1.5]), ConfigError, ("entry 0 is 1.5", "not an int")),
    "sizes_bool": (lambda r: build(sizes=[True]), ConfigError, ("entry 0 is True",)),
    "max_size_zero": (
        lambda r: build(sizes=None, options=gg.CaptureOptions(max_size=0)),
        ConfigError,
        ("max_size",),
    ),
    "max_size_bool": (
        lambda r: build(sizes=None, options=gg.CaptureOptions(max_size=True)),
        ConfigError,
        ("max_size",),
    ),
    # ---- example inputs
    "example_bare_tensor": (
        lambda r: build(example_inputs=torch.zeros(3, 6)),
        ConfigError,
        ("example_inputs is a single tensor", "example_inputs=(x,)"),
    ),
    "example_dict": (
        lambda r: build(example_inputs={"x": torch.zeros(3)}),
        ConfigError,
        ("example_inputs must be a list",),
    ),
    "example_empty": (lambda r: build(example_inputs=[]), ConfigError, ("at least one",)),
    "example_not_tensor": (
        lambda r: build(example_inputs=[torch.zeros(3, 6), [1, 2, 3]]),
        ConfigError,
        ("input[1] is a list, not a tensor",),
    ),
    "example_0d": (
        lambda r: build(example_inputs=[torch.zeros(())], callable_=lambda t: t),
        ConfigError,
        ("0-d", "batch dimension"),
    ),
    "example_sparse": (lambda r: sparse_input(), ConfigError, ("layout", "to_dense()")),
    "example_two_devices": (
        lambda r: build(example_inputs=[torch.zeros(3, 6), torch.zeros(3, device="meta")]),
        ConfigError,
        ("different devices", "input[1] on meta"),
    ),
    # ---- hooks, arenas, flags
    "before_capture_not_list": (
        lambda r: build(before_capture=print),
        ConfigError,
        ("before_capture must be a list of hooks", "before_capture=[...]"),
    ),
    "after_capture_not_list": (
        lambda r: build(options=gg.CaptureOptions(after_capture=print)),
        ConfigError,
        ("after_capture must be a list",),
    ),
    "hook_not_callable": (
        lambda r: build(before_capture=[1]),
        ConfigError,
        ("before_capture[0] is int",),
    ),
    "workspaces_not_list": (
        lambda r: build(workspaces=gg.Workspace("a", "cpu")),
        ConfigError,
        ("workspaces must be a list of Workspaces", "workspaces=[...]"),
    ),
    "workspaces_wrong_item": (
        lambda r: build(workspaces=["a"]),
        ConfigError,
        ("workspaces[0] is str",),
    ),
    "copy_outputs_str": (
        lambda r: build(options=gg.CaptureOptions(copy_outputs="yes")),
        ConfigError,
        ("copy_outputs must be True or False", "'yes'"),
    ),
    "share_outputs_int": (lambda r: build(share_outputs=1), ConfigError, ("share_outputs",)),
    "progress_str": (lambda r: build(progress="no"), ConfigError, ("progress",)),
    "warmup_iters_str": (
        lambda r: build(options=gg.CaptureOptions(warmup_iters="2")),
        ConfigError,
        ("warmup_iters must be an int >= 0", "str '2'", "warmup_iters=2"),
    ),
    "warmup_iters_bool": (
        lambda r: build(options=gg.CaptureOptions(warmup_iters=True)),
        ConfigError,
        ("warmup_iters",),
    ),
    "warmup_iters_negative": (
        lambda r: build(options=gg.CaptureOptions(warmup_iters=-1)),
        ConfigError,
        ("warmup_iters",),
    ),
    "warmup_iters_float": (
        lambda r: build(options=gg.CaptureOptions(warmup_iters=1.0)),
        ConfigError,
        ("warmup_iters",),
    ),
    "on_capture_error": (
        lambda r: build(options=gg.CaptureOptions(on_capture_error="ignore")),
        ConfigError,
        ("on_capture_error must be 'raise' or 'skip'",),
    ),
    "capture_error_mode": (
        lambda r: build(options=gg.CaptureOptions(capture_error_mode="loose")),
        ConfigError,
        ("capture_error_mode",),
    ),
    "mode_none_object": (
        lambda r: build(mode=None),
        ConfigError,
        ("mode must be a graphguard.Mode or its name", "mode='none'"),
    ),
    "mode_int": (lambda r: build(mode=3), ConfigError, ("mode must be",)),
    "mode_unknown": (lambda r: build(mode="sometimes"), ConfigError, ("unknown mode",)),
    "state_int": (lambda r: build(state=5), ConfigError, ("state:", "state={")),
    # ---- names and batch dims
    "names_count": (
        lambda r: build(names=["x"]),
        ConfigError,
        ("names: got 1 names for 2 inputs",),
    ),
    "names_string": (lambda r: build(names="x"), ConfigError, ("names=['x']",)),
    "names_duplicate": (lambda r: build(names=["x", "x"]), ConfigError, ("distinct",)),
    "batch_dims_range": (
        lambda r: build(options=gg.CaptureOptions(batch_dims=5)),
        ConfigError,
        ("batch_dims[0]=5 is out of range",),
    ),
    "batch_dims_str": (
        lambda r: build(options=gg.CaptureOptions(batch_dims="0")),
        ConfigError,
        ("batch_dims[0] is str",),
    ),
    "batch_dims_count": (
        lambda r: build(options=gg.CaptureOptions(batch_dims=[0, 0, 0])),
        ConfigError,
        ("batch_dims: got 3 values for 2 inputs",),
    ),
    # ---- fill values
    "fill_count": (lambda r: build(fill_values=(0, 1, 2)), ConfigError, ("fill_values: got 3",)),
    "fill_float_for_int64": (
        lambda r: one_input(torch.int64, 3.7),
        ConfigError,
        ("3.7", "torch.int64", "not a whole number"),
    ),
    "fill_negative_for_uint8": (
        lambda r: one_input(torch.uint8, -1),
        ConfigError,
        ("-1", "0..255", "wrap"),
    ),
    "fill_300_for_int8": (lambda r: one_input(torch.int8, 300), ConfigError, ("-128..127",)),
    "fill_nan_for_int": (lambda r: one_input(torch.int32, float("nan")), ConfigError, ("nan",)),
    "fill_inf_for_int": (lambda r: one_input(torch.int64, float("inf")), ConfigError, ("inf",)),
    "fill_str": (lambda r: one_input(torch.float32, "0"), ConfigError, ("not a number",)),
    "fill_huge_for_half": (
        lambda r: one_input(torch.float16, 1e6),
        ConfigError,
        ("range of torch.float16",),
    ),
    "fill_2_for_bool": (lambda r: one_input(torch.bool, 2), ConfigError, ("0/1/True/False",)),
    "fill_integral_float_ok": (integral_float_fill_is_accepted, None, ()),
    # ---- call time
    "call_wrong_count": (lambda r: r(batch(2)[0]), InputMismatchError, ("expected 2 inputs",)),
    "call_no_inputs": (lambda r: r(), InputMismatchError, ("expected 2 inputs", "got 0")),
    "call_wrong_dtype": (
        lambda r: r(batch(2)[0].double(), batch(2)[1]),
        InputMismatchError,
        ("input[0]: expected dtype torch.float32, got torch.float64",),
    ),
    "call_wrong_trailing_shape": (
        lambda r: r(torch.zeros(2, 5), batch(2)[1]),
        InputMismatchError,
        ("input[0]: expected shape",),
    ),
    "call_batch_disagree": (
        lambda r: r(batch(3)[0], batch(4)[1]),
        InputMismatchError,
        ("batch size 4 differs from input[0]'s batch size 3",),
    ),
    "call_batch_zero": (
        lambda r: r(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)),
        InputMismatchError,
        ("batch size is 0",),
    ),
    "call_not_tensor": (
        lambda r: r([[0.0] * 6], batch(1)[1]),
        InputMismatchError,
        ("expected a tensor",),
    ),
    "call_wrong_device": (
        lambda r: r(torch.zeros(2, 6, device="meta"), batch(2)[1]),
        InputMismatchError,
        ("expected device cpu, got meta",),
    ),
    "call_above_ladder_runs_eagerly": (
        lambda r: torch.testing.assert_close(r(*batch(11)), fn(*batch(11))),
        None,
        (),
    ),
    # ---- zero-copy path, estimation, lifecycle misuse
    "replay_zero": (lambda r: r.replay(0), GraphGuardError, ("no graph for a batch of 0",)),
    "replay_above": (lambda r: r.replay(100), GraphGuardError, ("no graph for a batch of 100",)),
    "static_inputs_above": (lambda r: r.static_inputs(9), GraphGuardError, ("runs them eagerly",)),
    "estimate_sample_above_ladder": (
        lambda r: r.estimate_graph_memory(sample_sizes=[100]),
        ConfigError,
        ("sample_sizes [100] are not capture sizes", "runner.sizes"),
    ),
    "estimate_sample_int": (
        lambda r: r.estimate_graph_memory(sample_sizes=4),
        ConfigError,
        ("sample_sizes must be a list",),
    ),
    "capture_twice": (lambda r: r.capture(), GraphGuardError, ("already captured", "recapture")),
    "recapture_no_reason": (lambda r: r.recapture(reason=""), ConfigError, ("reason",)),
    "inplace_writer_without_warmup": (inplace_writer_without_warmup, None, ()),
    # ---- dispatch
    "batchkey_bool": (
        lambda r: BatchKey(True),
        ConfigError,
        ("num_tokens must be a positive int",),
    ),
    "batchkey_zero": (lambda r: BatchKey(0), ConfigError, ("num_tokens",)),
    "batchkey_float": (lambda r: BatchKey(2.0), ConfigError, ("num_tokens",)),  # type: ignore[arg-type]
    "batchkey_reqs_above_tokens": (lambda r: BatchKey(3, 5), ConfigError, ("num_reqs",)),
    "batchkey_uniform_str": (lambda r: BatchKey(2, 2, "yes", 1), ConfigError, ("uniform must be",)),  # type: ignore[arg-type]
    "batchkey_uniform_mismatch": (
        lambda r: BatchKey(5, 2, True, 2),
        ConfigError,
        ("num_tokens == num_reqs * query_len",),
    ),
    "plan_max_tokens_bool": (
        lambda r: DispatchPlan("full", max_tokens=True),
        ConfigError,
        ("max_tokens must be a positive int",),
    ),
    "plan_query_len_bool": (
        lambda r: DispatchPlan("full", max_tokens=8, query_len=True),
        ConfigError,
        ("query_len",),
    ),
    "plan_full_sizes_int": (
        lambda r: DispatchPlan("full", max_tokens=8, full_sizes=8),  # type: ignore[arg-type]
        ConfigError,
        ("full_sizes must be a list",),
    ),
    "plan_full_mixed_str": (
        lambda r: DispatchPlan("full", max_tokens=8, full_mixed="yes"),  # type: ignore[arg-type]
        ConfigError,
        ("full_mixed must be True or False",),
    ),
    "plan_mode_none_object": (
        lambda r: DispatchPlan(None, max_tokens=8),  # type: ignore[arg-type]
        ConfigError,
        ("mode must be",),
    ),
    "dispatcher_key_disagrees_with_inputs": (
        key_mismatch,
        InputMismatchError,
        ("says 2 tokens", "has 5 rows", "build the key from the batch"),
    ),
    "capture_sizes_bool": (lambda r: gg.capture_sizes(True), ConfigError, ("max_size",)),
    "capture_sizes_multiple_bool": (
        lambda r: gg.capture_sizes(8, multiple_of=True),
        ConfigError,
        ("multiple_of",),
    ),
    # ---- state= that declared nothing (issue 20 item 6)
    "state_name_not_tensor": (
        lambda r: build(state=["cache"]),
        ConfigError,
        ("state[0] is str 'cache', not a tensor", "a name declares nothing", "state=[model.cache]"),
    ),
    "state_dict_python_number": (
        lambda r: build(state={"cache": CACHE, "pos": 5}),
        ConfigError,
        ("state['pos'] is int 5, not a tensor", "0-d device tensor"),
    ),
    "state_none_entry": (lambda r: build(state=[CACHE, None]), ConfigError, ("state[1] is",)),
    "state_nested_name": (
        lambda r: build(state={"layers": [CACHE, "v"]}),
        ConfigError,
        ("state['layers'][1] is str 'v'",),
    ),
    "state_meta_tensor": (
        lambda r: build(state=[torch.zeros(8, 6, device="meta")]),
        ConfigError,
        ("state[0] (float32 [8, 6]) is on the meta device", "materialized"),
    ),
    "state_generator": (
        lambda r: build(state=(t for t in [CACHE])),
        ConfigError,
        ("got generator", "state={"),
    ),
    "state_tuple_key": (
        lambda r: build(state={("k", 0): CACHE}),
        ConfigError,
        ("key ('k', 0)", "use strings"),
    ),
    # ---- a bool is not a size (issue 20 item 6)
    "replay_true": (
        lambda r: r.replay(True),
        ConfigError,
        ("replay(n) takes a batch size", "from 1 to 8", "got bool True"),
    ),
    "replay_false": (lambda r: r.replay(False), ConfigError, ("replay(n)", "bool False")),
    "static_inputs_true": (
        lambda r: r.static_inputs(True),
        ConfigError,
        ("static_inputs(n) takes a batch size", "bool True"),
    ),
    "replay_str": (lambda r: r.replay("2"), ConfigError, ("replay(n)", "str '2'")),  # type: ignore[arg-type]
    "graph_true": (lambda r: r.graph(True), ConfigError, ("graph(size)", "bool True")),
    "graph_missing": (lambda r: r.graph(3), GraphGuardError, ("no graph of size 3",)),
    "reserve_true": (
        lambda r: workspace_then_good(lambda ws: ws.reserve(True)),
        ConfigError,
        ("Workspace 'scratch': reserve(nbytes)", "got bool True"),
    ),
    "reserve_float": (
        lambda r: workspace_then_good(lambda ws: ws.reserve(1e9)),  # type: ignore[arg-type]
        ConfigError,
        ("reserve(nbytes)", "float 1000000000.0"),
    ),
    "workspace_alignment_bool": (
        lambda r: gg.Workspace("w", "cpu", alignment=True),
        ConfigError,
        ("alignment must be a positive power of two", "True"),
    ),
    # ---- huge requests: a graphguard error with the bytes (issue 20 item 8)
    "reserve_huge": (
        lambda r: workspace_then_good(lambda ws: ws.reserve(2**60)),
        ConfigError,
        ("Workspace 'scratch'", "test_bad_inputs.py", "1152921504606846976 B", "has in all"),
    ),
    "workspace_get_huge": (
        lambda r: workspace_then_good(lambda ws: ws.get(((2**30, 2**30), torch.float32))),
        ConfigError,
        ("Workspace 'scratch'", "4611686018427387904 B", "shapes passed to get()"),
    ),
    "workspace_get_huge_locked": (  # impossible, not "locked: reserve() it"
        lambda r: workspace_then_good(lambda ws: ws.get(((2**62,), torch.int8)), lock=True),
        ConfigError,
        ("4611686018427387904 B", "can never hold it"),
    ),
    "sizes_huge": (
        lambda r: build(sizes=[2**40]),
        ConfigError,
        (
            "sizes: the largest capture size 1099511627776",
            "input[0] torch.float32 [1099511627776, 6] on cpu: 24.0 TiB",
            "input[1] torch.int64 [1099511627776] on cpu: 8.0 TiB",
            "has. Pass smaller capture sizes",
        ),
    ),
    "example_batch_zero": (
        lambda r: build(
            example_inputs=(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)), sizes=None
        ),
        ConfigError,
        ("sizes: none given", "batch size, which is 0", "max_size=N"),
    ),
    "call_sparse": (
        lambda r: r(torch.zeros(2, 6).to_sparse(), batch(2)[1]),
        InputMismatchError,
        ("input[0]: expected a dense (strided) tensor, got layout torch.sparse_coo", "to_dense()"),
    ),
    "call_sparse_csr": (
        lambda r: r(sparse_csr(torch.zeros(2, 6)), batch(2)[1]),
        InputMismatchError,
        ("layout torch.sparse_csr",),
    ),
    "released_call": (released_call, None, ()),
    # ---- streams (issue 20 items 6 and 8)
    "aux_name_int": (
        lambda r: gg.AuxStream(name=123),  # type: ignore[arg-type]
        ConfigError,
        ("AuxStream(name=...) must be a non-empty string", "int 123"),
    ),
    "aux_priority_str": (
        lambda r: gg.AuxStream("rope", priority="high"),  # type: ignore[arg-type]
        ConfigError,
        ("AuxStream 'rope': priority must be an int", "str 'high'"),
    ),
    "aux_device_bogus": (
        lambda r: gg.AuxStream("rope", device="bogus"),
        ConfigError,
        ("AuxStream 'rope': device='bogus' is not a torch device", "'cuda:1'"),
    ),
    "aux_backend_wrong": (
        lambda r: gg.AuxStream("rope", backend=object()),  # type: ignore[arg-type]
        ConfigError,
        ("AuxStream 'rope': backend lacks", "record_event"),
    ),
    "fork_non_tensors": (
        lambda r: aux_then_good(fork_non_tensors),
        ConfigError,
        ("AuxStream 'rope': fork(*tensors): argument 0 is int 5, not a tensor",),
    ),
    "keep_non_tensor": (
        lambda r: aux_then_good(keep_non_tensor),
        ConfigError,
        ("keep(*tensors): argument 0 is str 'x'",),
    ),
    "watch_stream_name_int": (
        lambda r: gg.watch_stream(BrokenStream(), 5),  # type: ignore[arg-type]
        ConfigError,
        ("watch_stream(stream, name): name must be a non-empty string", "int 5"),
    ),
    "watched_stream_query_fails": (broken_watched_stream, None, ()),
    # ---- verify's arguments (issue 20 item 8)
    "verify_rtol_negative": (
        verify_then_good(rtol=-1),
        ConfigError,
        ("GraphRunner(fn): verify(rtol=-1)", "finite and >= 0"),
    ),
    "verify_atol_nan": (verify_then_good(atol=float("nan")), ConfigError, ("verify(atol=nan)",)),
    "verify_rtol_str": (
        verify_then_good(rtol="1e-3"),
        ConfigError,
        ("verify(rtol=...) must be a number", "str '1e-3'"),
    ),
    "verify_rtol_bool": (verify_then_good(rtol=True), ConfigError, ("verify(rtol=...)",)),
    "verify_sizes_int": (
        verify_then_good(sizes=4),
        ConfigError,
        ("verify(sizes=...) must be a list of captured sizes", "sizes=[4]"),
    ),
    "verify_sizes_bool": (verify_then_good(sizes=[True]), ConfigError, ("[True] are not ints",)),
    "verify_sizes_uncaptured": (
        verify_then_good(sizes=[3]),
        ConfigError,
        ("[3], which have no graph",),
    ),
    "verify_make_inputs_int": (
        verify_then_good(make_inputs=5),
        ConfigError,
        ("verify(make_inputs=...) must be a function",),
    ),
    "verify_raise_on_fail_str": (
        verify_then_good(raise_on_fail="no"),
        ConfigError,
        ("verify(raise_on_fail=...) must be True or False", "str 'no'"),
    ),
    "verify_seed_str": (verify_then_good(seed="0"), ConfigError, ("verify(seed=...)", "str '0'")),
    "gg_verify_not_a_runner": (
        lambda r: gg.verify(5),  # type: ignore[arg-type]
        ConfigError,
        ("verify(runner): expected a graphguard runner", "int 5"),
    ),
    # ---- found probing as a hostile user
    "capture_sizes_huge": (
        lambda r: gg.capture_sizes(2**40),
        ConfigError,
        ("max_size=1099511627776 is above 16777216", "MAX_SIZE"),
    ),
    "estimate_sample_str": (
        lambda r: r.estimate_graph_memory(sample_sizes="a"),
        ConfigError,
        ("sample_sizes must be a list of ints, got str 'a'",),
    ),
    "workspace_alignment_huge": (
        lambda r: gg.Workspace("w", "cpu", alignment=2**40).get(((1,), torch.int8)),
        ConfigError,
        ("asked for 1 B", "with alignment=1099511627776"),
    ),
    "workspace_unlocked_bad_reason_while_open": (
        lambda r: workspace_then_good(lambda ws: ws.unlocked(5).__enter__()),  # type: ignore[arg-type]
        ConfigError,
        ("unlock(reason=...) needs a non-empty reason",),
    ),
    "split_ops_string": (
        lambda r: gg.PiecewiseRunner(fn, example(), split_ops="mylib::attn", progress=False),  # type: ignore[arg-type]
        ConfigError,
        ("split_ops must be a list of the ops", "str 'mylib::attn'"),
    ),
    "split_op_dotted_name": (
        lambda r: gg.PiecewiseRunner(fn, example(), split_ops=["aten.softmax"], progress=False),
        ConfigError,
        ("give the qualified name 'namespace::op'", "'aten::softmax'"),
    ),
    "example_nested": (
        lambda r: build(example_inputs=(nested(), torch.zeros(2, dtype=torch.long))),
        ConfigError,
        ("input[0] has layout nested", "to_padded_tensor"),
    ),
    "example_quantized": (
        lambda r: build(example_inputs=(quantized(), torch.zeros(2, dtype=torch.long))),
        ConfigError,
        ("input[0] is quantized (torch.quint8)", "int_repr()"),
    ),
    "call_nested_strided": (
        lambda r: r(nested(), batch(2)[1]),
        InputMismatchError,
        ("input[0]: expected a dense (strided) tensor, got layout nested",),
    ),
    "call_nested_jagged": (
        lambda r: r(nested(torch.jagged), batch(2)[1]),
        InputMismatchError,
        ("input[0]: expected a dense (strided) tensor",),
    ),
    "gg_verify_rtol_negative": (lambda r: gg.verify(r, rtol=-1e-3), ConfigError, ("verify(rtol=",)),
}


@pytest.fixture
def good() -> gg.GraphRunner:
    r = build(fill_values=(0.0, 5))
    r.capture()
    return r


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case: str, good: gg.GraphRunner) -> None:
    action, error, fragments = CASES[case]
    if error is None:
        action(good)
    else:
        with pytest.raises(error) as ei:
            action(good)
        assert isinstance(ei.value, GraphGuardError), (
            f"{type(ei.value).__name__} is not graphguard's"
        )
        msg = str(ei.value)
        for frag in fragments:
            assert frag in msg, f"{frag!r} not in {msg!r}"
    for n in (3, 8, 1):  # the runner still serves correctly afterwards
        x, idx = batch(n, seed=n)
        torch.testing.assert_close(good(x, idx), fn(x, idx))


def test_static_buffers_that_fit_the_device_but_not_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An allocation failure at construction is a ConfigError with the bytes per input."""
    import graphguard.buffers as buffers

    def oom(*args: Any, **kw: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(buffers.torch, "full", oom)
    with pytest.raises(ConfigError) as ei:
        build()
    msg = str(ei.value)
    for frag in (
        "largest capture size 8",
        "input[0] torch.float32 [8, 6] on cpu: 192 B",
        "input[1] torch.int64 [8] on cpu: 64 B",
        "OutOfMemoryError: CUDA out of memory",
        "Pass smaller capture sizes",
    ):
        assert frag in msg, f"{frag!r} not in {msg!r}"
    assert isinstance(ei.value.__cause__, torch.OutOfMemoryError)
    monkeypatch.undo()
    r = build()
    r.capture()
    x, idx = batch(5)
    torch.testing.assert_close(r(x, idx), fn(x, idx))


def test_state_list_of_modules_is_walked_again_at_each_snapshot() -> None:
    """A module inside state=[...] that rebinds its buffer is still covered (and restored)."""

    class Cache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("kv", torch.zeros(8, 6))

    cache = Cache()

    def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        cache.kv[: x.shape[0]].add_(x)
        return fn(x, idx) + cache.kv[: x.shape[0]]

    r = build(callable_=step, state=[cache], fill_values=(1.0, 5))  # warmups add 1.0
    cache.kv = torch.full((8, 6), 2.0)  # rebound after the runner was built
    r.capture()
    assert torch.equal(cache.kv, torch.full((8, 6), 2.0))  # capture left it as it found it
    x, idx = batch(3)
    want = fn(x, idx) + 2.0 + x
    torch.testing.assert_close(r(x, idx), want)


def test_replay_refuses_bools_without_a_type_check_on_the_int_path() -> None:
    """replay(n) for an int still takes the list-index fast path (no isinstance)."""
    import dis

    from graphguard.ladder import Ladder

    names = {i.argval for i in dis.get_instructions(Ladder.replay)}
    assert "isinstance" not in names and "is_int" not in names and "type" not in names


def test_million_token_plan_builds_quickly() -> None:
    import time

    t0 = time.perf_counter()
    plan = DispatchPlan("full_and_piecewise", max_tokens=1_000_000)
    elapsed = time.perf_counter() - t0
    assert plan.resolve(BatchKey.decode(999_999)).size == 1_000_000
    assert plan.resolve(BatchKey.mixed(300)).size == 304
    assert elapsed < 20, f"{elapsed:.1f} s"  # was ~63 s (quadratic size validation)


def test_size_validation_is_linear() -> None:
    import time

    sizes = list(range(1, 200_001))
    from graphguard.sizes import PaddingTable, validate_sizes

    t0 = time.perf_counter()
    validate_sizes(sizes)
    PaddingTable(sizes)
    assert time.perf_counter() - t0 < 10


def test_a_cuda_index_the_machine_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:N past the last GPU used to be accepted and fail at the first fork/allocation."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for make in (
        lambda: gg.AuxStream("rope", device="cuda:2"),
        lambda: gg.Workspace("w", "cuda:2"),
    ):
        with pytest.raises(
            ConfigError,
            match=r"device='cuda:2' is not a torch device \(this machine has 2 CUDA device",
        ):
            make()
    assert gg.AuxStream("rope", device="cuda:1").device == torch.device("cuda:1")


def test_estimate_sample_sizes_from_a_generator_are_all_sampled() -> None:
    """The check used to read the generator, leaving nothing for the estimate itself."""
    seen: list[int] = []

    def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        seen.append(int(x.shape[0]))
        return fn(x, idx)

    r = build(callable_=step)
    r.estimate_graph_memory(sample_sizes=(s for s in (2, 4)))
    assert {2, 4, 8} <= set(seen)  # the largest size is always sampled
    seen.clear()
    r.estimate_graph_memory(sample_sizes=[1])
    assert set(seen) == {1, 8}
    r.capture()
    x, idx = batch(3)
    torch.testing.assert_close(r(x, idx), fn(x, idx))
