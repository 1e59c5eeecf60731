"""Workspace arenas: growth while open, aligned views, locking (seed 002)."""

from __future__ import annotations

import itertools
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from graphguard import phase
from graphguard.errors import ConfigError, GraphGuardError, WorkspaceLockedError
from graphguard.phase import Phase
from graphguard.workspace import Workspace


@pytest.fixture(autouse=True)
def _reset_phase() -> Iterator[None]:
    phase.reset()
    yield
    phase.reset()


def _line_after() -> int:
    """The line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


def test_default_device_is_cpu_without_cuda_and_arena_starts_empty() -> None:
    ws = Workspace("scratch")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ws.device.type == expected
    assert ws.nbytes == 0
    assert ws.peak_bytes == 0
    assert not ws.locked
    assert ws.growths == 0


def test_first_request_grows_and_returns_view_of_requested_shape_and_dtype() -> None:
    ws = Workspace("scratch", "cpu")
    (t,) = ws.get(((4, 8), torch.float32))
    assert t.shape == (4, 8)
    assert t.dtype == torch.float32
    assert t.device.type == "cpu"
    assert ws.nbytes >= 4 * 8 * 4
    assert ws.growths == 1
    assert ws.peak_bytes == 4 * 8 * 4


def test_fitting_request_reuses_the_same_buffer_without_growth() -> None:
    ws = Workspace("scratch", "cpu")
    big = ws.view((1024,), torch.float32)
    growths, nbytes = ws.growths, ws.nbytes
    small = ws.view((16,), torch.float32)
    assert ws.growths == growths
    assert ws.nbytes == nbytes
    assert small.data_ptr() == big.data_ptr()
    assert small.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()


def test_growth_reallocates_a_larger_buffer_and_counts_it() -> None:
    ws = Workspace("scratch", "cpu")
    small = ws.view((16,), torch.float32)
    big = ws.view((100_000,), torch.float32)
    assert ws.growths == 2
    assert ws.nbytes >= 400_000
    assert big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    assert ws.peak_bytes == 400_000


def test_growth_rounds_up_so_creeping_requests_do_not_reallocate_every_time() -> None:
    ws = Workspace("scratch", "cpu")
    for n in range(100_000, 110_000, 100):
        ws.view((n,), torch.uint8)
    # 100 requests creeping by 0.1 % each: the size classes absorb them.
    assert ws.growths <= 2
    # ...while wasting at most one size class (12.5 %) plus the alignment granule.
    assert ws.nbytes <= 110_000 * 1.125 + ws.alignment


def test_growth_logs_at_debug_and_fitting_request_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ws = Workspace("logged", "cpu")
    with caplog.at_level(logging.DEBUG, logger="graphguard"):
        ws.view((256,), torch.float32)
        grew = [r for r in caplog.records if "logged" in r.getMessage()]
        assert len(grew) == 1
        assert grew[0].levelno == logging.DEBUG
        caplog.clear()
        ws.view((8,), torch.float32)
        assert caplog.records == []


def test_get_returns_several_non_overlapping_views_in_order() -> None:
    ws = Workspace("scratch", "cpu", alignment=64)
    a, b, c = ws.get(((10,), torch.float32), ((3, 5), torch.int64), ((7,), torch.bfloat16))
    assert (a.shape, b.shape, c.shape) == ((10,), (3, 5), (7,))
    assert (a.dtype, b.dtype, c.dtype) == (torch.float32, torch.int64, torch.bfloat16)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c)]
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    # Writing one view must not touch the others.
    a.fill_(1.0)
    b.fill_(2)
    c.fill_(3.0)
    assert torch.all(a == 1.0)
    assert torch.all(b == 2)
    assert torch.all(c == 3.0)
    # The first view starts at the arena start.
    assert a.data_ptr() == ws.view((1,), torch.uint8).data_ptr()


@pytest.mark.parametrize("alignment", [1, 16, 64, 256, 4096])
def test_every_view_address_is_aligned(alignment: int) -> None:
    ws = Workspace("aligned", "cpu", alignment=alignment)
    views = ws.get(
        ((3,), torch.uint8),
        ((5,), torch.float16),
        ((7,), torch.float64),
        ((1,), torch.complex128),
        ((9,), torch.int32),
    )
    for t in views:
        assert t.data_ptr() % max(alignment, t.element_size()) == 0, (alignment, t.dtype)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8,
        torch.int8,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
    ],
)
def test_views_of_every_dtype_are_writable_and_sized(dtype: torch.dtype) -> None:
    ws = Workspace("dtypes", "cpu")
    _pad, t = ws.get(((3,), torch.uint8), ((2, 3), dtype))
    assert t.dtype == dtype
    assert t.shape == (2, 3)
    assert t.is_contiguous()
    if dtype != torch.float8_e4m3fn:
        t.zero_()
        assert not t.to(torch.float64 if not dtype.is_complex else torch.complex128).any()


def test_zero_element_and_scalar_shapes_work_and_take_no_space_when_empty() -> None:
    ws = Workspace("shapes", "cpu")
    empty, scalar, after = ws.get(
        ((0, 5), torch.float32), ((), torch.float64), ((4,), torch.float32)
    )
    assert empty.shape == (0, 5)
    assert empty.numel() == 0
    assert scalar.shape == ()
    assert after.shape == (4,)
    # The empty view reserved nothing: the scalar starts at the arena start.
    assert scalar.data_ptr() == ws.view((1,), torch.uint8).data_ptr()
    only_empty = Workspace("only-empty", "cpu")
    (e,) = only_empty.get(((3, 0), torch.int64))
    assert e.shape == (3, 0)
    assert only_empty.nbytes == 0
    assert only_empty.growths == 0


def test_negative_shape_is_rejected_with_arena_name() -> None:
    ws = Workspace("neg", "cpu")
    with pytest.raises(ConfigError, match="'neg'"):
        ws.view((-1,), torch.float32)


def test_lock_allows_fitting_requests_without_allocation() -> None:
    ws = Workspace("locked", "cpu", reserve_bytes=4096)
    first = ws.view((1024,), torch.float32)
    ws.lock()
    assert ws.locked
    again = ws.view((1024,), torch.float32)
    a, b = ws.get(((10,), torch.float16), ((100,), torch.int32))
    assert again.data_ptr() == first.data_ptr()
    assert a.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert ws.growths == 1
    assert ws.nbytes == 4096


def test_lock_refuses_growth_with_every_field_in_error_and_message() -> None:
    ws = Workspace("attn-splitk", "cpu", reserve_bytes=1024)
    ws.lock()
    line = _line_after()
    with pytest.raises(WorkspaceLockedError) as info:
        ws.view((1000,), torch.float32)
    err = info.value
    assert isinstance(err, GraphGuardError)
    assert err.arena == "attn-splitk"
    assert err.requested == 4000
    assert err.locked == 1024
    assert err.site.endswith(f"test_workspace.py:{line + 1}")
    msg = str(err)
    assert "'attn-splitk'" in msg
    assert "4000 bytes" in msg
    assert "1024 bytes" in msg
    assert f"test_workspace.py:{line + 1}" in msg
    assert "before_capture" in msg
    assert "reserve(4000)" in msg
    # Nothing was reallocated, and the refused request is still recorded as the peak.
    assert ws.nbytes == 1024
    assert ws.growths == 1
    assert ws.peak_bytes == 4000


def test_locked_reserve_that_fits_is_a_noop_and_one_that_does_not_raises() -> None:
    ws = Workspace("res", "cpu", reserve_bytes=2048)
    ws.lock()
    ws.reserve(1000)
    assert ws.nbytes == 2048
    with pytest.raises(WorkspaceLockedError) as info:
        ws.reserve(10_000)
    assert info.value.requested == 10_000
    assert info.value.locked == 2048
    assert "test_workspace.py:" in info.value.site


def test_reserve_grows_exactly_to_the_alignment_granule_and_never_shrinks() -> None:
    ws = Workspace("res", "cpu", alignment=256)
    ws.reserve(1000)
    assert ws.nbytes == 1024
    assert ws.growths == 1
    ws.reserve(10)
    assert ws.nbytes == 1024
    assert ws.growths == 1
    ws.reserve(1025)
    assert ws.nbytes == 1280
    assert ws.growths == 2
    with pytest.raises(ConfigError, match=r"reserve\(nbytes\)"):
        ws.reserve(-1)


def test_reserve_bytes_in_constructor_preallocates() -> None:
    ws = Workspace("pre", "cpu", reserve_bytes=5000, alignment=512)
    assert ws.nbytes == 5120
    assert ws.growths == 1


def test_growth_during_a_real_capture_is_refused_but_allowed_when_profiling() -> None:
    ws = Workspace("cap", "cpu", reserve_bytes=256)
    with phase.enter(Phase.CAPTURE), pytest.raises(WorkspaceLockedError) as info:
        ws.view((1000,), torch.float32)
    assert "capture" in str(info.value)
    assert info.value.requested == 4000
    assert ws.nbytes == 256
    with phase.enter(Phase.CAPTURE):
        ws.view((10,), torch.float32)  # fits: fine while capturing
    with phase.enter(Phase.CAPTURE, profiling=True):
        ws.view((1000,), torch.float32)  # a throwaway profiling capture may grow
    assert ws.nbytes >= 4000
    with phase.enter(Phase.WARMUP):
        ws.view((100_000,), torch.float32)  # uncaptured warmup grows freely
    assert ws.nbytes >= 400_000


def test_unlock_requires_a_reason_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    ws = Workspace("w", "cpu")
    ws.lock()
    with pytest.raises(ConfigError, match="reason"):
        ws.unlock(reason="")
    assert ws.locked
    with caplog.at_level(logging.INFO, logger="graphguard"):
        ws.unlock(reason="weights reloaded, recapturing")
    assert not ws.locked
    assert any("weights reloaded, recapturing" in r.getMessage() for r in caplog.records)
    ws.view((4096,), torch.uint8)
    assert ws.nbytes >= 4096


def test_unlocked_context_allows_growth_and_relocks_even_on_error() -> None:
    ws = Workspace("ctx", "cpu", reserve_bytes=256)
    ws.lock()
    with ws.unlocked("recapture after weight reload"):
        assert not ws.locked
        ws.view((10_000,), torch.uint8)
    assert ws.locked
    assert ws.nbytes >= 10_000
    with pytest.raises(RuntimeError, match="boom"), ws.unlocked("test"):
        raise RuntimeError("boom")
    assert ws.locked
    with pytest.raises(WorkspaceLockedError):
        ws.view((1_000_000,), torch.uint8)


def test_unlocked_context_keeps_an_open_arena_open() -> None:
    ws = Workspace("open", "cpu")
    with ws.unlocked("nothing to unlock"):
        pass
    assert not ws.locked


def test_info_is_json_ready_and_reports_state() -> None:
    ws = Workspace("report", "cpu", alignment=128)
    ws.view((300,), torch.float32)
    ws.lock()
    info = ws.info()
    assert info["name"] == "report"
    assert info["device"] == "cpu"
    assert info["nbytes"] == ws.nbytes
    assert info["peak_bytes"] == 1200
    assert info["locked"] is True
    assert info["growths"] == 1
    assert info["alignment"] == 128
    assert json.loads(json.dumps(info)) == info


def test_invalid_configuration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="power of two"):
        Workspace("bad", "cpu", alignment=48)
    with pytest.raises(ConfigError, match="power of two"):
        Workspace("bad", "cpu", alignment=0)
    with pytest.raises(ConfigError, match="name"):
        Workspace("", "cpu")


def test_views_stay_valid_storage_after_growth_but_new_views_use_new_buffer() -> None:
    ws = Workspace("grow", "cpu")
    old = ws.view((4,), torch.float32)
    old.fill_(7.0)
    new = ws.view((1_000_000,), torch.float32)
    # The caller's old view keeps its storage alive (it is the captured-graph hazard
    # on CUDA, where the allocator would reuse it); its data is untouched here.
    assert torch.all(old == 7.0)
    assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_views_are_aligned_and_on_device() -> None:
    ws = Workspace("gpu", "cuda", alignment=256)
    views = ws.get(((3,), torch.uint8), ((5,), torch.bfloat16), ((2, 2), torch.float32))
    for t in views:
        assert t.is_cuda
        assert t.data_ptr() % 256 == 0


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "spec",
    [
        ((4, 8), "float16"),  # dtype string
        (None, torch.float32),  # None shape
        ((4, 2.5), torch.float32),  # float dim
        ((4.0,), torch.float32),  # float dim, integral value
        (8, torch.float32),  # bare int shape
        ((True, 4), torch.float32),  # bool dim
        (torch.float32,),  # not a pair
    ],
)
def test_bad_get_arguments_are_config_errors_naming_the_argument(spec: object) -> None:
    ws = Workspace("args", "cpu")
    with pytest.raises(ConfigError) as info:
        ws.get(((2,), torch.int8), spec)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "'args'" in msg and "argument 1" in msg and "(shape, dtype)" in msg
    if spec != ((True, 4), torch.float32):  # a bool dim is caught at the view, after sizing
        assert ws.nbytes == 0 and ws.peak_bytes == 0  # refused before any growth
    (ok,) = ws.get(((4, 8), torch.float16))  # the arena still works
    assert ok.shape == (4, 8)


def test_cuda_workspace_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=r"device='cuda' but CUDA is not available.*device='cpu'"):
        Workspace("gpu-arena", device="cuda")
    with pytest.raises(ConfigError, match="not a torch device"):
        Workspace("bad", device="gpu0")


def test_failed_growth_keeps_the_old_buffer_and_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace("oom", "cpu")
    (a,) = ws.get(((256,), torch.float32))
    a.fill_(3.0)
    buffer, capacity, peak, growths = ws.buffer, ws.nbytes, ws.peak_bytes, ws.growths
    real_empty = torch.empty

    def failing_empty(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("emulated out of memory")

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(torch.OutOfMemoryError) as info:
        ws.get(((1 << 20,), torch.float32))
    monkeypatch.setattr(torch, "empty", real_empty)
    if hasattr(info.value, "add_note"):  # Python 3.11+
        assert any("'oom'" in n and "keeps its" in n for n in info.value.__notes__)
    assert ws.buffer is buffer and ws.nbytes == capacity
    assert ws.peak_bytes == peak and ws.growths == growths
    (again,) = ws.get(((256,), torch.float32))
    assert again.data_ptr() == a.data_ptr()
    assert float(again[0]) == 3.0  # same memory, untouched


def test_locked_refusal_still_records_the_peak_for_reserve() -> None:
    ws = Workspace("peak", "cpu", reserve_bytes=1024)
    ws.lock()
    with pytest.raises(WorkspaceLockedError):
        ws.get(((1024,), torch.float32))
    assert ws.peak_bytes == 4096  # reserve(peak_bytes) before capture is the fix


def test_a_request_larger_than_the_device_is_refused_before_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Larger than the device's whole memory: a ConfigError naming arena, bytes and line
    (was the allocator's raw error); growth within it is untouched, also when locked."""
    import graphguard.workspace as workspace

    monkeypatch.setattr(workspace, "device_total_bytes", lambda device: 1 << 20)
    ws = Workspace("kv-scratch", "cpu")
    ws.reserve(512 << 10)  # fits a 1 MiB device
    with pytest.raises(ConfigError) as info:
        ws.reserve(2 << 20)
    msg = str(info.value)
    assert "Workspace 'kv-scratch'" in msg and "2.0 MiB (2097152 B)" in msg
    assert "test_workspace.py" in msg and "has in all" in msg
    with pytest.raises(ConfigError, match="can never hold it"):
        ws.get(((1 << 20,), torch.float32))
    assert ws.nbytes == 512 << 10 and ws.peak_bytes == 0  # nothing grew, nothing counted
    ws.lock()
    with pytest.raises(ConfigError, match="can never hold it"):  # not "reserve() it"
        ws.get(((1 << 20,), torch.float32))
    with pytest.raises(WorkspaceLockedError):  # possible, but locked: the usual error
        ws.get(((200_000,), torch.float32))
    (v,) = ws.get(((1000,), torch.float32))
    assert v.shape == (1000,)


@pytest.mark.parametrize("bad", [True, False, 1.0, "4096", None])
def test_reserve_takes_a_byte_count_not_a_flag(bad: Any) -> None:
    ws = Workspace("a", "cpu")
    with pytest.raises(ConfigError, match=r"reserve\(nbytes\) needs an int >= 0"):
        ws.reserve(bad)
    assert ws.nbytes == 0
    ws.reserve(4096)
    assert ws.nbytes == 4096
