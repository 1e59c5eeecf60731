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
