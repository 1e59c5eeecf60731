"""The demo's mode plumbing on the CPU: engine loop, scheduler, dispatcher wiring, CLI.

Graphs are emulated by the RecordingBackend, so every mode (NONE, PIECEWISE, FULL,
FULL_AND_PIECEWISE) runs its real runners and dispatcher here; the GPU equivalent is
``tests/gpu/test_modes_gpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from graphguard.backend import RecordingBackend
from graphguard.dispatch import BatchKey
from graphguard.errors import ConfigError
from graphguard.piecewise import PiecewiseRunner
from graphguard.runner import GraphRunner
from graphguard_ref.cli import main
from graphguard_ref.demo import run_engine_demo, uses_engine_loop
from graphguard_ref.llama import MIXED_ATTENTION_OP, LlamaConfig, LlamaDecodeModel
from graphguard_ref.serving_loop import (
    EngineScheduler,
    Request,
    Rows,
    build_dispatcher,
    default_max_tokens,
    make_batch,
    release,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------ the engine demo

EXPECTED = {
    # batch label -> what may run it
    "none": {"verify": {"none"}, "mixed": {"none"}},
    "full": {"verify": {"full"}, "mixed": {"none"}},
    "piecewise": {"verify": {"piecewise"}, "mixed": {"piecewise", "none"}},
    "full_and_piecewise": {"verify": {"full"}, "mixed": {"piecewise", "none"}},
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_engine_demo_runs_every_mode_through_its_runners_and_equals_eager(mode, tmp_path):
    lines: list[str] = []
    path = tmp_path / "demo.json"
    result = run_engine_demo(
        preset="tiny",
        max_batch=4,
        max_context=48,
        sizes=[3, 6, 12, 16],
        steps=24,
        phases=(4, 1, 3),
        mode=mode,
        spec_tokens=2,
        prompt_len=6,
        chunk=8,
        device="cpu",
        make_backend=RecordingBackend,
        json_path=path,
        out=lines.append,
    )
    text = "\n".join(lines)
    assert f"mode {mode}" in text and "dispatch plan" in text
    # The plan is printed before the capture reports.
    assert text.index("dispatch plan") < max(text.find("captured"), text.find("check vs eager"))
    assert result.mode == mode and result.requested_mode == mode and result.loop == "engine"
    assert result.plan is not None and result.plan["query_len"] == 3
    assert result.check["steps"] == 24
    assert result.check["max_abs_logit_diff"] < 1e-4
    assert result.check["argmax_agreement"] == 1.0
    if mode == "none":
        assert result.check["bitwise_equal_steps"] == 24
    assert set(result.dispatch) == {"verify", "mixed"}
    for label, ran in result.dispatch.items():
        assert set(ran) <= EXPECTED[mode][label], (label, ran)
    assert result.spec["drafted"] > 0 and result.spec["verify_rows"] > 0
    data = json.loads(path.read_text())
    assert data["mode"] == mode and data["spec_tokens"] == 2 and data["plan"]["mode"] == mode
    if mode != "none":
        assert data["capture"] is not None


def test_engine_demo_without_cuda_runs_the_requested_mode_under_the_recording_backend():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    lines: list[str] = []
    result = run_engine_demo(
        max_batch=4, max_context=32, steps=6, mode="piecewise", out=lines.append
    )
    text = "\n".join(lines)
    assert "CUDA graphs need an NVIDIA GPU" in text and "model: tiny" in text
    assert "mode piecewise under the RecordingBackend" in text
    assert result.mode == "piecewise" and result.requested_mode == "piecewise"
    assert set().union(*map(set, result.dispatch.values())) == {"piecewise"}
    assert result.check["argmax_agreement"] == 1.0 and result.per_kind == []  # untimed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cli_demo_with_mode_and_spec_tokens_on_cpu_explains_and_exits_zero(capsys, tmp_path):
    path = tmp_path / "demo.json"
    rc = main(
        [
            "--mode",
            "full_and_piecewise",
            "--spec-tokens",
            "2",
            "--steps",
            "8",
            "--max-batch",
            "4",
            "--context",
            "32",
            "--json",
            str(path),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert "CUDA graphs need an NVIDIA GPU" in captured.out
    assert "dispatch plan" in captured.out and "full_and_piecewise" in captured.out
    assert "q=3" in captured.out
    assert "WARNING" not in captured.out + captured.err  # no warning from our own demo
    data = json.loads(path.read_text())
    assert data["mode"] == "full_and_piecewise" and data["device"] == "cpu"
    assert data["loop"] == "engine" and data["spec_tokens"] == 2
    assert {"full", "piecewise"} >= set().union(*map(set, data["dispatch"].values()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cli_demo_default_still_runs_the_decode_loop(capsys, tmp_path):
    path = tmp_path / "demo.json"
    argv = ["--steps", "4", "--max-batch", "4", "--context", "16", "--json", str(path)]
    assert main(argv) == 0
    assert json.loads(path.read_text())["loop"] == "decode"
    assert "decode loop" in capsys.readouterr().out


def test_cli_rejects_an_unknown_mode():
    with pytest.raises(SystemExit):
        main(["--mode", "fastest"])


@pytest.mark.parametrize(
    ("mode", "spec", "engine", "expected"),
    [
        ("full", 0, False, False),
        ("none", 0, False, False),
        ("full", 2, False, True),
        ("none", 0, True, True),
        ("piecewise", 0, False, True),
        ("full_and_piecewise", 0, False, True),
    ],
)
def test_which_loop_the_demo_runs(mode, spec, engine, expected):
    assert uses_engine_loop(mode, spec, engine) is expected


# ------------------------------------------------------------------ dispatcher wiring


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [
        ("none", False, False),
        ("full", True, False),
        ("piecewise", False, True),
        ("full_and_piecewise", True, True),
    ],
)
def test_build_dispatcher_wires_the_runners_each_mode_needs(mode, full, piecewise):
    model = LlamaDecodeModel.random(LlamaConfig.preset("tiny", max_context=32), seed=0)
    d = build_dispatcher(model, mode, max_tokens=20, query_len=3, make_backend=RecordingBackend)
    assert isinstance(d.full, GraphRunner) is full
    assert isinstance(d.piecewise, PiecewiseRunner) is piecewise
    assert d.eager == model.mixed_step
    if full:
        assert all(s % 3 == 0 for s in d.plan.full_sizes)
        assert d.full is not None and tuple(d.full.sizes) == d.plan.full_sizes
    if piecewise:
        assert isinstance(d.piecewise, PiecewiseRunner)
        assert d.piecewise.compiler.matcher.names == {MIXED_ATTENTION_OP}
        assert tuple(d.piecewise.sizes) == d.plan.piecewise_sizes
    assert d.plan.resolve(BatchKey.decode(4, 3)).kind == (
        "full" if full else "piecewise" if piecewise else "none"
    )
    assert d.plan.resolve(BatchKey.mixed(7, 2)).kind == ("piecewise" if piecewise else "none")


def _rows(*spec: tuple[int, str]) -> list[Rows]:
    out, start = [], 0
    for i, (n, kind) in enumerate(spec):
        drafts = tuple(range(n - 1)) if kind == "verify" else ()
        out.append(Rows(i, start, n, kind, drafts))  # type: ignore[arg-type]
        start += n
    return out


def _distinct(n: int) -> tuple[list[int], list[int], list[int]]:
    """``n`` tokens with distinct (slot, position) pairs."""
    return [1] * n, list(range(n)), [0] * n


def test_make_batch_keys_uniform_decode_verify_and_mixed():
    b = make_batch([1, 2], [0, 0], [0, 1], _rows((1, "decode"), (1, "decode")), CPU)
    assert b.key == BatchKey.decode(2, 1) and b.label == "decode"
    b = make_batch(*_distinct(6), _rows((3, "verify"), (3, "verify")), CPU)
    assert b.key == BatchKey.decode(2, 3) and b.label == "verify"
    b = make_batch(*_distinct(4), _rows((1, "decode"), (3, "verify")), CPU)
    assert b.key == BatchKey.mixed(4, 2) and b.label == "mixed"
    b = make_batch(*_distinct(4), _rows((3, "verify"), (1, "prefill")), CPU)
    assert b.key == BatchKey.mixed(4, 2)
    assert b.token_ids.dtype == torch.long and b.inputs[2].shape == (4,)


# ------------------------------------------------------------------ scheduler


def sched(**kw) -> EngineScheduler:
    kw.setdefault("max_batch", 2)
    kw.setdefault("max_context", 32)
    kw.setdefault("max_tokens", 16)
    kw.setdefault("vocab", 50)
    return EngineScheduler(**kw)


def test_prompts_prefill_in_chunks_then_requests_decode_uniformly():
    s = sched(prompt_len=5, chunk=3)
    s.set_live(2)
    lengths = [len(r.prompt) for r in s.live]
    steps = 0
    while any(r.prefilling for r in s.live):
        b = s.next_batch(CPU)
        assert b is not None and b.label == "mixed"
        assert all(r.kind == "prefill" and r.length <= 3 for r in b.rows)
        s.commit(b, [7] * b.num_tokens)
        steps += 1
    assert steps == max(-(-n // 3) for n in lengths)
    assert [r.pos for r in s.live] == lengths and all(r.out == [7] for r in s.live)
    b = s.next_batch(CPU)
    assert b is not None and b.key == BatchKey.decode(2, 1)
    assert b.positions.tolist() == lengths and b.token_ids.tolist() == [7, 7]


def test_verify_accepts_drafts_while_they_match_greedy_and_rolls_back_the_rest():
    s = sched(spec_tokens=2)
    req = Request(rid=0, slot=1, prompt=[5, 6, 7, 5], max_new=100, pos=4, out=[6])
    s.live = [req]
    b = s.next_batch(CPU)
    assert b is not None and b.key == BatchKey.decode(1, 3)
    # Prompt lookup: 6 occurred before at index 1, followed by 7, 5.
    assert b.rows[0].drafts == (7, 5)
    assert b.token_ids.tolist() == [6, 7, 5] and b.positions.tolist() == [4, 5, 6]
    s.commit(b, [7, 9, 1])  # draft 7 accepted, draft 5 rejected (greedy says 9)
    assert req.out == [6, 7, 9] and req.pos == 6
    assert (s.stats.drafted, s.stats.accepted, s.stats.emitted) == (2, 1, 2)
    b = s.next_batch(CPU)
    assert b is not None and b.positions.tolist() == [6, 7, 8]  # overwrites the rejected slot
    s.commit(b, [*b.rows[0].drafts, 4])  # everything accepted, plus the bonus token
    assert req.pos == 9 and req.out[-1] == 4 and s.stats.accepted == 3


def test_spec_false_decodes_one_token_and_prefill_false_holds_chunks_back():
    s = sched(spec_tokens=2, max_batch=3, max_tokens=20)
    s.live = [
        Request(0, 0, [1, 2], 100, pos=2, out=[3]),
        Request(1, 1, [4, 5, 6, 7], 100, pos=0),
    ]
    b = s.next_batch(CPU, spec=False, prefill=False)
    assert b is not None and b.key == BatchKey.decode(1, 1)
    b = s.next_batch(CPU, spec=True, prefill=True)
    assert b is not None and b.key == BatchKey.mixed(3 + 4, 2)
    s.live = [Request(1, 1, [4, 5, 6, 7], 100, pos=0)]
    b = s.next_batch(CPU, prefill=False)  # nothing decodes: the chunk runs anyway
    assert b is not None and b.rows[0].kind == "prefill"


def test_live_count_changes_finish_and_admit_requests_reusing_slots():
    s = sched(max_batch=4, max_tokens=16)
    s.set_live(4)
    assert sorted(r.slot for r in s.live) == [0, 1, 2, 3] and not s.free
    s.set_live(1)
    assert (
        len(s.live) == 1
        and len(s.finished) == 3
        and sorted(s.free) == sorted({0, 1, 2, 3} - {s.live[0].slot})
    )
    s.set_live(3)
    assert len({r.slot for r in s.live}) == 3


def test_requests_finish_before_their_context_runs_out():
    s = sched(max_batch=1, max_context=12, max_tokens=8, spec_tokens=2, max_new=1000, seed=3)
    s.set_live(1)
    for _ in range(40):
        b = s.next_batch(CPU)
        if b is None:
            break
        assert max(b.positions.tolist()) < 12
        s.commit(b, [1] * b.num_tokens)
        s.set_live(1)
    assert len(s.finished) >= 1


def test_scheduler_refuses_a_budget_below_one_verify_step_per_request():
    with pytest.raises(ConfigError, match="max_tokens"):
        EngineScheduler(max_batch=8, max_context=64, max_tokens=20, vocab=10, spec_tokens=2)
    assert default_max_tokens(8, 2, 16) == 8 * 3 + 16


# ------------------------------------------------------------------ the benchmark


def test_bench_modes_runs_its_plumbing_on_cpu_and_writes_json(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "bench_modes.py"
    spec = importlib.util.spec_from_file_location("bench_modes", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "modes.json"
    result = bench.main(
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--context",
            "64",
            "--spec-tokens",
            "1",
            "--decode",
            "1,3",
            "--mixed",
            "2:5",
            "--reps",
            "1",
            "--blocks",
            "1",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["query_len"] == 2 and data == json.loads(json.dumps(result))
    assert set(data["capture"]) == {"none", "piecewise", "full", "full_and_piecewise"}
    ran = {(r["batch"], m): r[m]["ran"] for r in data["rows"] for m in bench.MODES}
    assert ran[("decode", "full")] == "full" and ran[("decode", "full_and_piecewise")] == "full"
    assert ran[("mixed", "full")] == "none" and ran[("mixed", "piecewise")] == "piecewise"
    assert ran[("mixed", "full_and_piecewise")] == "piecewise"
    assert all(r[m]["max_abs_diff"] < 1e-4 for r in data["rows"] for m in bench.MODES)


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_the_reference_dispatcher_captures_without_a_warning(mode, caplog):
    """Its KV writes at the scratch slot are declared (state=[]); FULL gets no split op."""
    model = LlamaDecodeModel.random(LlamaConfig.preset("tiny", max_context=32), seed=0)
    d = build_dispatcher(model, mode, max_tokens=12, query_len=3, make_backend=RecordingBackend)
    with caplog.at_level("WARNING", logger="graphguard"), torch.inference_mode():
        d.capture()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    release(d)
