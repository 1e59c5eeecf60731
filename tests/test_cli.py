from __future__ import annotations

import json

import pytest
import torch

from graphguard_ref.cli import main
from graphguard_ref.demo import Sequences, batch_schedule


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_demo_on_cpu_explains_and_exits_zero(capsys, tmp_path):
    path = tmp_path / "demo.json"
    rc = main(
        ["demo", "--steps", "12", "--max-batch", "16", "--context", "32", "--json", str(path)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "CUDA graphs need a GPU" in out
    assert "tiny" in out
    data = json.loads(path.read_text())
    assert data["mode"] == "none" and data["device"] == "cpu"


def test_doctor_runs(capsys):
    assert main(["doctor"]) == 0
    assert "graphguard" in capsys.readouterr().out


def test_schedule_moves_through_the_phases_capped_at_max_batch():
    s = batch_schedule(8, (8, 1, 37, 256), max_batch=64)
    assert s == [8, 8, 1, 1, 37, 37, 64, 64]


def test_sequences_restart_when_joining_and_wrap_at_context():
    seqs = Sequences(4, 3, torch.device("cpu"))
    assert seqs.step_inputs(2)[0].tolist() == [0, 0]
    assert seqs.step_inputs(2)[0].tolist() == [1, 1]
    assert seqs.step_inputs(4)[0].tolist() == [2, 2, 0, 0]
    assert seqs.step_inputs(1)[0].tolist() == [0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_demo_tp_on_cpu_runs_two_gloo_ranks_eagerly(capsys, tmp_path):
    path = tmp_path / "tp.json"
    rc = main(
        [
            "demo",
            "--tp",
            "2",
            "--steps",
            "6",
            "--max-batch",
            "8",
            "--context",
            "32",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    assert path.exists()


# ------------------------------------------------------------------ bad flags

BAD_FLAGS = [
    (["--steps", "0"], "--steps"),
    (["--steps", "ten"], "--steps"),
    (["--max-batch", "0"], "--max-batch"),
    (["--context", "0"], "--context"),
    (["--sizes", "0,2"], "--sizes"),
    (["--sizes", ","], "--sizes"),
    (["--sizes", "1,x"], "--sizes"),
    (["--phases", "-3"], "--phases"),
    (["--chunk", "0", "--engine"], "--chunk"),
    (["--max-tokens", "0", "--engine"], "--max-tokens"),
    (["--prompt-len", "0", "--engine"], "--prompt-len"),
    (["--tp", "-1"], "--tp"),
    (["--tp", "0"], "--tp"),
    (["--tp", "3"], "--tp 3"),  # tiny (CPU) and llama-1b heads do not divide by 3
    (["--tp", "2", "--spec-tokens", "1"], "--spec-tokens"),
    (["--tp", "2", "--mode", "piecewise"], "--tp"),
    (["--preset", "bogus"], "--preset"),
    (["--mode", "fastest"], "--mode"),
    (["--spec-tokens", "-1"], "--spec-tokens"),
    (["--chunk", "8"], "--chunk"),  # an engine-loop flag on the decode loop
    (["--full-mixed", "--mode", "full_and_piecewise"], "--full-mixed"),
    (["--engine", "--sanitize"], "--sanitize"),
    (["--engine", "--spec-tokens", "2", "--context", "4"], "--context"),
    (["--engine", "--max-batch", "8", "--max-tokens", "4"], "--max-tokens"),
    (["--engine", "--spec-tokens", "2", "--sizes", "1,2,4"], "--sizes"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Any demo that starts fails the test: bad flags must stop before the work."""
    import graphguard_ref.cli as cli

    def started(*args, **kwargs):
        raise AssertionError("the demo started despite a bad flag")

    monkeypatch.setattr(cli, "run_demo", started)
    monkeypatch.setattr(cli, "run_tp_demo", started)


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_a_one_line_usage_error_with_exit_code_2(flags, named, capsys, no_work):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("graphguard demo: error: "), err
    assert named in err[-1]
    assert not any("Traceback" in line for line in err)


def test_json_into_an_unwritable_path_is_refused_before_the_demo(tmp_path, capsys, no_work):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--json", str(blocker / "out.json")])
    assert exc.value.code == 2
    assert "--json" in capsys.readouterr().err.strip().splitlines()[-1]
    assert blocker.read_text() == ""


def test_json_check_leaves_no_file_behind(tmp_path, monkeypatch):
    import graphguard_ref.cli as cli

    seen = []
    monkeypatch.setattr(cli, "run_demo", lambda **kw: seen.append(kw["json_path"].exists()))
    path = tmp_path / "new" / "out.json"
    assert main(["demo", "--json", str(path)]) == 0
    assert seen == [False]


def test_good_flags_reach_the_demo_unchanged(monkeypatch):
    import graphguard_ref.cli as cli

    calls = []
    monkeypatch.setattr(cli, "run_demo", lambda **kw: calls.append(kw))
    assert main(["demo", "--engine", "--spec-tokens", "0", "--sizes", "1 2,4", "--chunk", "8"]) == 0
    assert calls[0]["sizes"] == [1, 2, 4] and calls[0]["chunk"] == 8
    assert calls[0]["prompt_len"] == 16 and calls[0]["max_tokens"] is None


def test_console_command_exits_2_without_a_traceback():
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "graphguard_ref.cli", "demo", "--steps", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("graphguard demo: error: argument --steps")
    )
