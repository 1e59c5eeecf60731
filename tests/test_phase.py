from __future__ import annotations

import threading

import pytest

import graphguard as gg
from graphguard import phase
from graphguard.errors import CaptureTripwireError
from graphguard.phase import Phase


def test_default_phase_is_eager_and_overlap_is_allowed():
    assert gg.phase.current_phase() is Phase.EAGER
    assert not gg.is_capturing()
    assert not gg.phase.in_graph_preparation()
    assert gg.overlap_allowed()


@pytest.mark.parametrize(
    ("p", "capturing", "preparing", "overlap"),
    [
        (Phase.PROFILING, False, False, True),
        (Phase.WARMUP, False, True, False),
        (Phase.CAPTURE, True, True, True),
        (Phase.SERVING, False, False, True),
    ],
)
def test_queries_follow_the_transient_phase(p, capturing, preparing, overlap):
    with phase.enter(p):
        assert gg.phase.current_phase() is p
        assert gg.is_capturing() is capturing
        assert gg.phase.in_graph_preparation() is preparing
        assert gg.overlap_allowed() is overlap
    assert gg.phase.current_phase() is Phase.EAGER


def test_transient_phases_nest_and_restore():
    with phase.enter(Phase.WARMUP):
        with phase.enter(Phase.CAPTURE):
            assert gg.is_capturing()
        assert gg.phase.current_phase() is Phase.WARMUP
    assert gg.phase.current_phase() is Phase.EAGER


def test_phase_is_restored_when_the_block_raises():
    with pytest.raises(ValueError), phase.enter(Phase.CAPTURE):
        raise ValueError
    assert gg.phase.current_phase() is Phase.EAGER


def test_serving_is_process_wide_and_reset_clears_it():
    phase.set_serving()
    seen = []
    t = threading.Thread(target=lambda: seen.append(gg.phase.current_phase()))
    t.start()
    t.join()
    assert gg.phase.current_phase() is Phase.SERVING
    assert seen == [Phase.SERVING]
    phase.reset()
    assert gg.phase.current_phase() is Phase.EAGER


def test_background_thread_does_not_see_another_threads_capture():
    inside = threading.Event()
    release = threading.Event()
    seen: dict[str, object] = {}

    def capturer():
        with phase.capture_window("test"), phase.enter(Phase.CAPTURE):
            seen["capturer"] = gg.is_capturing()
            inside.set()
            release.wait(5)

    def observer():
        inside.wait(5)
        seen["observer_capturing"] = gg.is_capturing()
        seen["observer_overlap"] = gg.overlap_allowed()
        seen["observer_window"] = phase.capture_window_owner()
        release.set()

    threads = [threading.Thread(target=capturer), threading.Thread(target=observer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {
        "capturer": True,
        "observer_capturing": False,
        "observer_overlap": True,
        "observer_window": None,
    }


def test_warmup_in_one_thread_does_not_disable_overlap_in_another():
    inside = threading.Event()
    release = threading.Event()
    result = []

    def warm():
        with phase.enter(Phase.WARMUP):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=warm)
    t.start()
    inside.wait(5)
    result.append(gg.overlap_allowed())
    release.set()
    t.join()
    assert result == [True]


def test_tripwire_raises_outside_the_window_and_names_the_caller():
    with pytest.raises(CaptureTripwireError) as ei:
        phase.check_capture_allowed("PiecewiseBackend(size 48)")
    msg = str(ei.value)
    assert msg.startswith("PiecewiseBackend(size 48) tried to capture")
    assert "GraphRunner.capture()" in msg


def test_tripwire_is_silent_inside_the_window_and_closes_after():
    with phase.capture_window("runner"):
        phase.check_capture_allowed("x")
        assert phase.capture_window_owner() == "runner"
    with pytest.raises(CaptureTripwireError):
        phase.check_capture_allowed("x")


def test_capture_window_of_one_thread_does_not_open_it_for_another():
    errors = []
    inside = threading.Event()
    release = threading.Event()

    def owner():
        with phase.capture_window("main"):
            inside.set()
            release.wait(5)

    def intruder():
        inside.wait(5)
        try:
            phase.check_capture_allowed("background thread")
        except CaptureTripwireError as e:
            errors.append(e)
        release.set()

    ts = [threading.Thread(target=owner), threading.Thread(target=intruder)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(errors) == 1


def test_profiling_flag():
    assert not phase.is_profiling()
    with phase.enter(Phase.CAPTURE, profiling=True):
        assert phase.is_profiling() and gg.is_capturing()
    with phase.enter(Phase.PROFILING):
        assert phase.is_profiling()
