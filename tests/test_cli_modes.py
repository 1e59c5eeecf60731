"""``graphguard-demo`` tells the truth about its mode (issue 29): ``--mode none`` on a CPU
is honoured (nothing captured, said so) and ``--engine --mode none`` never claims a capture
lifecycle. That ``--tp 2`` (eager on a CPU) never claims a "graph vs eager" check is in
tests/ref/test_cli.py, beside the one test that starts the two ranks."""

from __future__ import annotations

import json

import pytest
import torch

from graphguard_ref.cli import main

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
SMALL = ["--steps", "6", "--max-batch", "8", "--context", "32"]


@cpu_only
def test_mode_none_on_a_cpu_is_honoured_and_said(capsys, tmp_path):
    path = tmp_path / "none.json"
    assert main(["--mode", "none", *SMALL, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["mode"] == "none" and data["capture"] is None
    assert data["check"]["steps"] == 6 and data["check"]["bitwise_equal_steps"] == 6
    assert "mode none: nothing is captured" in out
    assert "1. mode none: no capture ran" in out
    for claim in ("capture lifecycle", "capture of sizes", "replay bitwise equal", "locked at"):
        assert claim not in out, claim
    assert "locked_arena_error" not in data["check"]


@cpu_only
def test_the_default_mode_still_captures_and_says_so(capsys, tmp_path):
    path = tmp_path / "full.json"
    assert main([*SMALL, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["mode"] == "full" and data["capture"]["captured"] == [1, 2, 4, 8]
    assert "capture lifecycle" in out and "1. capture of sizes [8, 4, 2, 1]" in out
    assert "mode none" not in out


@cpu_only
def test_engine_mode_none_does_not_claim_a_capture_lifecycle(capsys, tmp_path):
    path = tmp_path / "engine.json"
    assert main(["--engine", "--mode", "none", *SMALL, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "capture lifecycle" not in out and "records each step and replays" not in out
    assert "mode none: the engine loop runs every step eagerly" in out
    assert json.loads(path.read_text())["mode"] == "none"


@cpu_only
def test_engine_mode_full_still_names_its_capture_lifecycle(capsys):
    assert main(["--engine", "--mode", "full", *SMALL]) == 0
    assert "capture lifecycle are real" in capsys.readouterr().out
