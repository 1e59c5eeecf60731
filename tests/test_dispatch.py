"""The dispatcher: batch keys, their relaxation, the resolved plan and its report."""

from __future__ import annotations

import logging

import pytest
import torch

from graphguard.config import Mode
from graphguard.dispatch import BatchKey, Decision, Dispatcher, DispatchPlan
from graphguard.errors import ConfigError

FULL = [1, 2, 4, 8, 16, 32]
PW = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def plan(mode: str, **kw):
    kw.setdefault("max_tokens", 600)
    kw.setdefault("full_sizes", FULL if Mode.parse(mode).has_full else None)
    kw.setdefault("piecewise_sizes", PW if Mode.parse(mode).has_piecewise else None)
    return DispatchPlan(mode, **kw)


# ------------------------------------------------------------------------- BatchKey


def test_decode_key_counts_tokens_as_requests_times_query_len():
    k = BatchKey.decode(5, query_len=3)
    assert (k.num_tokens, k.num_reqs, k.uniform, k.query_len) == (15, 5, True, 3)
    assert BatchKey.decode(7) == BatchKey(7, 7, True, 1)


def test_keys_are_hashable_and_equal_by_value():
    d = {BatchKey.decode(4): "a", BatchKey.mixed(4, 2): "b"}
    assert d[BatchKey.decode(4)] == "a"
    assert d[BatchKey.mixed(4, 2)] == "b"
    assert BatchKey.decode(4) != BatchKey.mixed(4, 4)


@pytest.mark.parametrize(
    "args",
    [
        (0, None, False, 0),
        (4, 5, False, 0),
        (4, 2, True, 1),
        (4, None, True, 4),
        (4, 2, False, 2),
    ],
)
def test_inconsistent_keys_are_rejected(args):
    with pytest.raises(ConfigError, match="invalid BatchKey"):
        BatchKey(*args)


def test_relax_goes_uniform_then_tokens_only_then_nothing():
    k = BatchKey.decode(4, query_len=2)
    assert k.relax() == BatchKey(8)
    assert BatchKey(8).relax() is None
    assert k.relaxations() == (k, BatchKey(8))
    assert BatchKey.mixed(9, 3).relaxations() == (BatchKey.mixed(9, 3), BatchKey(9))


# ------------------------------------------------------------------- resolve per mode


def test_full_mode_pads_uniform_decode_to_the_next_full_size():
    d = plan("full").resolve(BatchKey.decode(5))
    assert d == Decision("full", BatchKey.decode(8), d.reason)
    assert d.size == 8


def test_full_mode_runs_uniform_decode_above_largest_full_size_eagerly():
    d = plan("full").resolve(BatchKey.decode(33))
    assert d.kind == "none"
    assert d.padded_key == BatchKey(33)
    assert "largest FULL size 32" in d.reason


def test_full_mode_runs_mixed_batches_eagerly_unless_full_mixed():
    assert plan("full").resolve(BatchKey.mixed(5, 2)).kind == "none"
    d = plan("full", full_mixed=True).resolve(BatchKey.mixed(5, 2))
    assert (d.kind, d.padded_key) == ("full", BatchKey(8))


def test_piecewise_mode_sends_uniform_decode_to_piecewise_graphs_and_says_so():
    d = plan("piecewise").resolve(BatchKey.decode(5))
    assert (d.kind, d.padded_key) == ("piecewise", BatchKey(8))
    assert d.reason == "mode PIECEWISE: uniform decode keys use piecewise graphs"


def test_full_and_piecewise_uses_full_for_decode_and_piecewise_for_mixed():
    p = plan("full_and_piecewise")
    assert p.resolve(BatchKey.decode(3)).kind == "full"
    assert p.resolve(BatchKey.mixed(3, 2)).kind == "piecewise"
    above_full = p.resolve(BatchKey.decode(40))
    assert (above_full.kind, above_full.size) == ("piecewise", 64)
    assert "largest FULL size 32" in above_full.reason
    assert p.resolve(BatchKey.mixed(513, 2)).kind == "none"


def test_none_mode_runs_everything_eagerly():
    p = plan("none")
    for key in (BatchKey.decode(4), BatchKey.mixed(4, 2), BatchKey(1000)):
        assert p.resolve(key).kind == "none"
    assert p.downgrades() == []


def test_above_max_tokens_is_eager_and_logged_once(caplog):
    p = plan("full_and_piecewise")
    with caplog.at_level(logging.INFO, logger="graphguard"):
        for n in (601, 700, 800):
            d = p.resolve(BatchKey.mixed(n, 1))
            assert d.kind == "none"
            assert "max_tokens 600" in d.reason
    assert sum("max_tokens" in r.getMessage() for r in caplog.records) == 1


def test_resolve_returns_the_same_precomputed_decision_object():
    p = plan("full_and_piecewise")
    assert p.resolve(BatchKey.decode(5)) is p.resolve(BatchKey.decode(6))


# ------------------------------------------------------------------------ spec decode


def test_spec_decode_full_sizes_must_be_multiples_of_query_len():
    with pytest.raises(ConfigError, match=r"\[4, 8\] are not multiples of query_len=3"):
        DispatchPlan("full", max_tokens=64, full_sizes=[3, 4, 6, 8], query_len=3)


def test_spec_decode_default_full_sizes_are_multiples_and_pad_to_whole_requests():
    p = DispatchPlan("full_and_piecewise", max_tokens=96, query_len=3)
    assert all(s % 3 == 0 for s in p.full_sizes)
    d = p.resolve(BatchKey.decode(5, query_len=3))
    assert d.kind == "full"
    assert d.padded_key == BatchKey.decode(8, query_len=3)
    assert any("spec decode q=3: FULL sizes are multiples of 3" in n for n in p.notes)
    assert "spec decode q=3" in p.table()


def test_uniform_key_with_another_query_len_is_relaxed_and_logged_once(caplog):
    p = DispatchPlan("full_and_piecewise", max_tokens=96, query_len=3)
    with caplog.at_level(logging.INFO, logger="graphguard"):
        d1 = p.resolve(BatchKey.decode(4, query_len=2))
        d2 = p.resolve(BatchKey.decode(5, query_len=2))
    assert (d1.kind, d1.padded_key) == ("piecewise", BatchKey(8))
    assert "q=2 but FULL graphs serve q=3" in d1.reason
    assert d2.kind == "piecewise"
    assert sum("q=2" in r.getMessage() for r in caplog.records) == 1


def test_sizes_above_max_tokens_are_rejected():
    with pytest.raises(ConfigError, match="above max_tokens=16"):
        DispatchPlan("piecewise", max_tokens=16, piecewise_sizes=[8, 16, 32])


# ---------------------------------------------------------------------------- report


def test_report_lists_every_range_with_kind_and_reason_for_full_and_piecewise():
    p = plan("full_and_piecewise")
    rows = {(r.keys, r.first, r.last): r for r in p.rows}
    assert rows[("uniform decode q=1", 1, 32)].kind == "full"
    assert rows[("uniform decode q=1", 33, 512)].kind == "piecewise"
    assert rows[("uniform decode q=1", 33, 512)].downgrade
    assert rows[("uniform decode q=1", 513, 600)].kind == "none"
    assert rows[("mixed", 1, 512)].kind == "piecewise"
    assert not rows[("mixed", 1, 512)].downgrade
    assert rows[("mixed", 513, 600)].reason == "num_tokens > largest piecewise size 512: eager"
    text = p.table()
    assert "num_tokens > largest FULL size 32: piecewise graphs" in text
    assert "* downgrade" in text


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("none", "mode NONE: every batch runs eagerly"),
        ("full", "mode FULL: mixed batches run eagerly"),
        ("piecewise", "mode PIECEWISE: uniform decode keys use piecewise graphs"),
        ("full_and_piecewise", "mixed batch: piecewise graphs"),
    ],
)
def test_report_of_each_mode_names_its_policy(mode, expected):
    p = plan(mode)
    assert expected in p.table()
    d = p.to_dict()
    assert d["mode"] == mode
    assert any(expected in r["reason"] for r in d["rows"])
    covered = sum(
        (r["num_tokens"][1] - r["num_tokens"][0]) // r["step"] + 1
        for r in d["rows"]
        if r["keys"] == "mixed"
    )
    assert covered == 600


def test_each_downgrade_row_is_logged_once_at_plan_time(caplog):
    with caplog.at_level(logging.INFO, logger="graphguard"):
        p = plan("full")
    logged = [r.getMessage() for r in caplog.records]
    assert len(p.downgrades()) == 2
    for row in p.downgrades():
        assert sum(row.reason in m for m in logged) == 1


def test_ignored_sizes_are_noted():
    p = DispatchPlan("full", max_tokens=64, piecewise_sizes=[8])
    assert "mode FULL: piecewise_sizes ignored (no piecewise graphs)" in p.notes


def test_with_sizes_narrows_to_what_captured_and_reports_an_empty_kind():
    p = plan("full_and_piecewise")
    q = p.with_sizes(full=[1, 2, 4])
    assert q.full_sizes == (1, 2, 4)
    assert q.resolve(BatchKey.decode(8)).kind == "piecewise"
    r = p.with_sizes(piecewise=[])
    assert r.mode is Mode.FULL
    assert "nothing captured for PIECEWISE" in r.notes[0]


# ------------------------------------------------------------------------ Dispatcher


class FakeRunner:
    def __init__(self, tag, sizes):
        self.tag = tag
        self.sizes = tuple(sizes)
        self.captured_sizes = tuple(sizes)
        self.calls = []

    def capture(self):
        from graphguard.report import CaptureReport

        return CaptureReport(mode=self.tag, backend="fake")

    def __call__(self, *inputs):
        self.calls.append(inputs)
        return self.tag


def test_dispatcher_routes_each_key_to_the_decided_runner():
    p = plan("full_and_piecewise")
    full, pw = FakeRunner("full", FULL), FakeRunner("piecewise", PW)
    d = Dispatcher(p, eager=lambda *x: "eager", full=full, piecewise=pw)
    d.capture()
    assert d(BatchKey.decode(3), "x") == "full"
    assert d(BatchKey.mixed(3, 2), "x") == "piecewise"
    assert d(BatchKey.mixed(599, 2), "x") == "eager"
    assert full.calls == [("x",)]


def test_dispatcher_rejects_runners_whose_sizes_differ_from_the_plan():
    p = plan("full_and_piecewise")
    with pytest.raises(ConfigError, match="full runner's sizes"):
        Dispatcher(p, eager=print, full=FakeRunner("f", [1, 2]), piecewise=FakeRunner("p", PW))
    with pytest.raises(ConfigError, match="needs a piecewise runner"):
        Dispatcher(p, eager=print, full=FakeRunner("f", FULL))


def test_dispatcher_narrows_the_plan_when_a_size_did_not_capture():
    p = plan("full_and_piecewise")
    full = FakeRunner("full", FULL)
    full.captured_sizes = (1, 2, 4, 8)
    d = Dispatcher(p, eager=print, full=full, piecewise=FakeRunner("piecewise", PW))
    d.capture()
    assert d.plan.full_sizes == (1, 2, 4, 8)
    assert d(BatchKey.decode(16), "x") == "piecewise"


# ------------------------------------------------------- call-time resolution, bad inputs


def test_rows_built_from_the_sizes_agree_with_resolve_at_every_token():
    for mode in ("none", "full", "piecewise", "full_and_piecewise"):
        for q, full_mixed in ((1, False), (1, True), (3, False)):
            p = DispatchPlan(
                mode,
                max_tokens=100,
                full_sizes=[3, 6, 12, 24] if Mode.parse(mode).has_full and q == 3 else None,
                piecewise_sizes=[1, 2, 4, 8, 16, 32, 40]
                if Mode.parse(mode).has_piecewise
                else None,
                query_len=q,
                full_mixed=full_mixed,
            )
            for label, make, step in (
                (f"uniform decode q={q}", lambda n, q=q: BatchKey.decode(n // q, q), q),
                ("mixed", lambda n: BatchKey.mixed(n, 1), 1),
            ):
                rows = [r for r in p.rows if r.keys == label]
                covered = [n for r in rows for n in range(r.first, r.last + 1, r.step)]
                assert covered == list(range(step, 101, step)), (mode, q, label)
                for r in rows:
                    for n in range(r.first, r.last + 1, r.step):
                        d = p.resolve(make(n))
                        assert (d.kind, d.reason) == (r.kind, r.reason), (mode, q, n)
                        assert d.size in r.sizes if d.kind != "none" else d.size == n


def test_a_huge_max_tokens_with_given_sizes_resolves_at_call_time():
    p = DispatchPlan(
        "full_and_piecewise", max_tokens=2**40, full_sizes=[1, 2, 4], piecewise_sizes=[8, 16]
    )
    assert p.resolve(BatchKey.decode(3)).size == 4
    assert p.resolve(BatchKey.mixed(9, 2)).size == 16
    beyond = p.resolve(BatchKey.mixed(2**39, 2))
    assert (beyond.kind, beyond.size) == ("none", 2**39)
    assert "largest piecewise size 16" in beyond.reason
    assert p.resolve(BatchKey(2**40 + 1)).reason.endswith("> max_tokens 1099511627776: eager")
    assert p.rows[-1].last == 2**40 and len(p.rows) == 5
    assert DispatchPlan("none", max_tokens=2**40).resolve(BatchKey(2**39)).kind == "none"


def test_a_default_ladder_past_the_largest_capture_size_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        DispatchPlan("full", max_tokens=2**40)
    msg = str(err.value)
    assert "max_tokens=1099511627776" in msg and "largest capture size 16777216" in msg
    assert "Pass full_sizes=" in msg and "lower max_tokens" in msg
    with pytest.raises(ConfigError, match="33554432 is above the largest capture size 16777216"):
        DispatchPlan("piecewise", max_tokens=2**26, piecewise_sizes=[8, 2**25])


@pytest.mark.parametrize("key", [4, None, (4, 4), "decode(4)", torch.zeros(4)])
def test_a_key_that_is_not_a_batchkey_is_a_config_error_naming_it_and_the_fix(key):
    d = Dispatcher(plan("full"), eager=lambda *x: "eager", full=FakeRunner("full", FULL))
    for call in (lambda: d(key, torch.zeros(4)), lambda: d.plan.resolve(key)):
        with pytest.raises(ConfigError) as err:
            call()
        msg = str(err.value)
        assert f"must be a graphguard.BatchKey, got {type(key).__name__}" in msg
        assert "BatchKey.decode(num_reqs, query_len)" in msg
        assert "BatchKey.mixed(num_tokens, num_reqs)" in msg
    assert d(BatchKey.decode(4), torch.zeros(4)) == "full"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: BatchKey(-3), "num_tokens must be a positive int, got -3"),
        (lambda: BatchKey(2.0), "num_tokens must be a positive int, got float 2.0"),
        (lambda: BatchKey(True), "num_tokens must be a positive int, got bool True"),
        (lambda: BatchKey(torch.tensor(3)), "got Tensor tensor(3) (pass int(...))"),
        (lambda: BatchKey(2, None, False, -1), "query_len must be an int >= 0, got -1"),
        (lambda: BatchKey.mixed(3, 0), "num_reqs must be a positive int, got 0"),
        (lambda: BatchKey.decode("2", 3), "num_reqs must be a positive int, got '2'"),
        (lambda: BatchKey.decode(2, True), "query_len must be a positive int, got bool True"),
        (lambda: BatchKey.decode(2, 0), "query_len must be a positive int, got 0"),
        (lambda: BatchKey.decode(-1), "num_reqs must be a positive int, got -1"),
    ],
)
def test_a_bad_key_field_is_a_config_error_naming_the_field_and_the_value(make, expected):
    with pytest.raises(ConfigError) as err:
        make()
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"max_tokens": -1}, "max_tokens must be a positive int"),
        ({"max_tokens": 8.0}, "max_tokens must be a positive int"),
        ({"max_tokens": "8"}, "got '8'"),
        ({"max_tokens": None}, "got None"),
        ({"query_len": 2.5}, "query_len must be a positive int (1 for decode"),
        ({"max_tokens": 2, "query_len": 3}, "max_tokens=2 is below query_len=3"),
        ({"name": 5}, "name must be a string, got 5"),
        ({"full_mixed": 1}, "full_mixed must be True or False, got 1"),
        ({"full_sizes": [1, 2, 2**25], "max_tokens": 2**25}, "above the largest capture size"),
    ],
)
def test_a_bad_plan_argument_is_a_config_error_naming_it(kw, expected):
    kw = {"max_tokens": 8, **kw}
    with pytest.raises(ConfigError) as err:
        DispatchPlan("full", **kw)
    assert expected in str(err.value)


def test_max_tokens_is_validated_in_the_plan_alone_with_one_wording():
    import graphguard as gg

    for bad in ({"max_tokens": 0}, {"max_tokens": 4, "query_len": 5}, {"query_len": True}):
        kw = {"max_tokens": 8, **bad}
        with pytest.raises(ConfigError) as from_plan:
            DispatchPlan("full", **kw)
        with pytest.raises(ConfigError) as from_builder:
            gg.build_dispatcher(
                lambda x: x,
                (torch.zeros(1, 2),),
                mode="full",
                backend_factory=gg.RecordingBackend,
                **kw,
            )
        assert str(from_plan.value) == str(from_builder.value)


def test_bad_dispatcher_and_builder_arguments_are_config_errors_naming_them():
    import graphguard as gg

    p = plan("full")
    for make, expected in (
        (
            lambda: Dispatcher("plan", eager=print),
            "plan must be a graphguard.DispatchPlan, got str",
        ),
        (lambda: Dispatcher(p, eager=None, full=FakeRunner("f", FULL)), "eager must be a callable"),
        (lambda: Dispatcher(p, eager=print, full=object()), "full must be a runner"),
        (lambda: p.with_sizes(full=5), "full must be a list of ints, got int 5"),
        (lambda: p.with_sizes(full=[1, 700]), "[700] are above max_tokens=600"),
        (
            lambda: gg.build_dispatcher(None, (torch.zeros(1, 2),), mode="full", max_tokens=8),
            "build_dispatcher: step must be a callable, got None",
        ),
        (
            lambda: gg.build_dispatcher(
                lambda x: x, (torch.zeros(1, 2),), mode="full", max_tokens=8, fullgraph="no"
            ),
            "fullgraph must be True or False, got 'no'",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            make()
        assert expected in str(err.value)


def test_the_provenance_environment_switch_reaches_the_dispatchers_full_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GRAPHGUARD_PROVENANCE means what it means for GraphRunner (PiecewiseRunner's pieces
    are tested in tests/test_provenance.py)."""
    import graphguard as gg

    monkeypatch.setenv("GRAPHGUARD_PROVENANCE", "1")
    lin = torch.nn.Linear(2, 2)
    d = gg.build_dispatcher(
        lin, (torch.zeros(1, 2),), mode="full", max_tokens=4, backend_factory=gg.RecordingBackend
    )
    assert d.full is not None
    d.full.capture()
    assert d.full.audit().enabled and d.full.audit().graphs


def test_the_layout_probes_forwards_stand_for_the_first_warmups_of_the_dispatchers_runners() -> (
    None
):
    """As for GraphRunner: up front, the probe's forward at the two largest sizes is their
    first warmup (the FULL runner's first size keeps its watched one: no ``state=``)."""
    import graphguard as gg

    lin = torch.nn.Linear(2, 2)
    d = gg.build_dispatcher(
        lin, (torch.zeros(1, 2),), mode="full", max_tokens=4, backend_factory=gg.RecordingBackend
    )
    assert d.full is not None
    report = d.full.capture()
    assert [(s.size, s.prewarmed, s.warmups) for s in report.sizes] == [
        (4, False, 1),
        (2, True, 0),
        (1, False, 1),
    ]
