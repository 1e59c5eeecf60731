"""``graphguard-demo``: the CPU demo shows something true, and every bad flag is one line,
exit code 2, before any model is built."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch

import graphguard
import graphguard_ref.cli as cli
from graphguard_ref.cli import main, resolve_defaults
from graphguard_ref.demo import Sequences, batch_schedule
from graphguard_ref.demo.cpu import lifecycle_lines
from graphguard_ref.llama import LlamaDecodeModel
from graphguard_ref.tp import TensorParallelLlama

ROOT = Path(__file__).resolve().parents[2]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


@cpu_only
def test_cpu_demo_shows_the_lifecycle_padding_and_locked_arena_error_fast(capsys, tmp_path):
    path = tmp_path / "demo.json"
    t0 = time.process_time()  # CPU seconds: a loaded CI machine must not make it flaky
    rc = main(["--json", str(path)])
    seconds = time.process_time() - t0
    out = capsys.readouterr().out
    assert rc == 0
    assert seconds < 15, f"the CPU demo took {seconds:.1f} CPU seconds"
    lines = out.splitlines()
    order = [
        "before_capture hook",
        "output-layout probe: warmup forward (batch 8) -> synchronize -> warmup forward "
        "(batch 4) -> synchronize",
        "synchronize (the hooks' work",
        "size 8: synchronize -> capture (its warmup: the probe's forward)",
        "size 4: synchronize -> capture (its warmup: the probe's forward)",
        "size 2: warmup forward (batch 2) -> synchronize -> capture",
        "size 1:",
        "arena 'llama.decode' locked",
        "2. decode loop",
        "WorkspaceLockedError: workspace arena 'llama.decode' is locked",
        "What a GPU adds",
    ]
    at = [next(i for i, line in enumerate(lines) if want in line) for want in order]
    assert at == sorted(at), out
    assert "argmax agreement" in out and "eager and eager" not in out
    assert "sanitizer:" not in out  # off unless asked
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["mode"] == "full"
    assert data["capture"]["captured"] == [1, 2, 4, 8]
    assert data["check"]["steps"] == 48 and data["check"]["argmax_agreement"] == 1.0
    assert 0 < data["check"]["bitwise_equal_steps"] <= 48
    assert data["check"]["locked_arena_error"].startswith("WorkspaceLockedError:")


@cpu_only
def test_cpu_demo_says_the_sanitizer_is_on_and_which_batches_run_eagerly(capsys, tmp_path):
    """--sanitize shows in the output; batches above the ladder are eager, not "padded"."""
    path = tmp_path / "demo.json"
    argv = ["--sizes", "3", "--sanitize", "--steps", "8", "--context", "32", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sanitizer: on (--sanitize; the runner is a GraphRunner)" in out
    assert "each run as 8 eager (above 3), 1->3, 5 eager (above 3), 3->3:" in out
    assert "8->8" not in out and "5->5" not in out
    assert json.loads(path.read_text())["sanitize"] is True


def test_lifecycle_lines_fold_each_sizes_warmups_into_its_capture_line():
    events = [
        ("hook",),
        ("synchronize",),
        ("warmup", 4),
        ("warmup", 4),
        ("synchronize",),
        ("capture_begin", 4),
        ("capture_end", 4),
        ("warmup", 2),
        ("synchronize",),
        ("capture_begin", 2),
        ("capture_end", 2),
        ("replay", 4),
        ("capture_begin", 1),
    ]
    assert lifecycle_lines(events) == [
        "before_capture hook: model.warm_kernels (sizes the arena while open)",
        "synchronize (the hooks' work done before any capture)",
        "size 4: warmup forward (batch 4) -> warmup forward (batch 4) -> synchronize -> capture",
        "size 2: warmup forward (batch 2) -> synchronize -> capture",
    ]


def test_lifecycle_lines_give_the_layout_probe_its_own_line():
    events = [
        ("hook",),
        ("warmup", 4),
        ("synchronize",),
        ("warmup", 2),
        ("synchronize",),
        ("synchronize",),
        ("warmup", 4),
        ("synchronize",),
        ("capture_begin", 4),
        ("capture_end", 4),
    ]
    assert lifecycle_lines(events) == [
        "before_capture hook: model.warm_kernels (sizes the arena while open)",
        "output-layout probe: warmup forward (batch 4) -> synchronize -> warmup forward "
        "(batch 2) -> synchronize",
        "synchronize (the hooks' work done before any capture)",
        "size 4: warmup forward (batch 4) -> synchronize -> capture",
    ]


def test_schedule_moves_through_the_phases_capped_at_max_batch():
    s = batch_schedule(8, (8, 1, 37, 256), max_batch=64)
    assert s == [8, 8, 1, 1, 37, 37, 64, 64]


def test_sequences_restart_when_joining_and_wrap_at_context():
    seqs = Sequences(4, 3, torch.device("cpu"))
    assert seqs.step_inputs(2)[0].tolist() == [0, 0]
    assert seqs.step_inputs(2)[0].tolist() == [1, 1]
    assert seqs.step_inputs(4)[0].tolist() == [2, 2, 0, 0]
    assert seqs.step_inputs(1)[0].tolist() == [0]


@pytest.mark.process
@cpu_only
def test_demo_tp_on_cpu_runs_two_gloo_ranks_eagerly_and_says_so(capsys, tmp_path):
    """Eager on a CPU, and said so: no rank claims a "graph vs eager" check (issue 29).
    The only test that starts the two ranks (spawning them is most of its cost)."""
    path = tmp_path / "tp.json"
    argv = ["--tp", "2", "--steps", "6", "--max-batch", "8", "--context", "32"]
    assert main([*argv, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["mode"] == "none" and [c["rank"] for c in data["checks"]] == [0, 1]
    assert all(c["steps"] == 6 and c["argmax_agreement"] == 1.0 for c in data["checks"])
    out = capsys.readouterr().out
    assert "eagerly (mode none)" in out
    assert "graph vs eager" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2, out
    assert all(
        "runner (mode none: eager, no graph) vs the model called directly" in ln for ln in lines
    )


def _resolved(argv: list[str], cuda: bool) -> argparse.Namespace:
    args = cli.build_parser().parse_args(argv)
    resolve_defaults(args, cuda)
    return args


def test_defaults_follow_the_machine_and_only_default_phases_are_capped():
    cpu = _resolved([], cuda=False)
    assert (cpu.preset, cpu.max_batch, cpu.context, cpu.steps) == ("tiny", 8, 64, 48)
    assert cpu.phases == [8, 1, 5, 3]
    gpu = _resolved([], cuda=True)
    assert (gpu.preset, gpu.max_batch, gpu.context, gpu.steps) == ("llama-1b", 256, 1024, 400)
    assert gpu.phases == [8, 1, 37, 256]
    assert _resolved(["--max-batch", "16"], cuda=True).phases == [8, 1, 16]
    assert _resolved(["--phases", "300"], cuda=True).phases == [300]  # refused later, not capped


# ------------------------------------------------------------------ bad flags

BAD_FLAGS = [
    (["--steps", "0"], "--steps"),
    (["--steps", "ten"], "--steps"),
    (["--steps", "10**22"], "--steps"),
    (["--steps", str(10**22)], "--steps"),
    (["--max-batch", "0"], "--max-batch"),
    (["--context", "0"], "--context"),
    (["--max-batch", "100000", "--context", "100000"], "--max-batch 100000 --context 100000"),
    (["--sizes", "0,2"], "--sizes"),
    (["--sizes", ","], "--sizes"),
    (["--sizes", ""], "--sizes"),
    (["--sizes", "1,x"], "--sizes"),
    (["--sizes", "1,2,,4"], "--sizes"),
    (["--sizes", "1 2,4"], "--sizes"),
    (["--sizes", "4,2,2"], "--sizes"),
    (["--sizes", "512", "--max-batch", "8"], "--sizes 512"),
    (["--sizes", str(2**40)], "--sizes"),
    (["--phases", "-3"], "--phases"),
    (["--phases", "300"], "--phases 300"),
    (["--phases", "1,9", "--max-batch", "8"], "--phases 1,9"),
    (["--chunk", "0", "--engine"], "--chunk"),
    (["--max-tokens", "0", "--engine"], "--max-tokens"),
    (["--max-tokens", str(10**9), "--engine"], "--max-tokens"),
    (["--prompt-len", "0", "--engine"], "--prompt-len"),
    (["--prompt-len", "500", "--engine", "--context", "64"], "--prompt-len 500"),
    (["--engine", "--max-batch", "4", "--sizes", "1,2,500"], "--sizes"),
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
    (["demo"], "unrecognized arguments: demo"),  # the old subcommand
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--preset", "llama-1b"], "--preset llama-1b needs a CUDA GPU"))
    BAD_FLAGS.append((["--tp", "2", "--mode", "full"], "--tp on a CPU runs eagerly"))


@pytest.fixture
def no_work(monkeypatch):
    """Building any model, or starting any demo, fails the test: bad flags stop before."""

    def built(*args, **kwargs):
        raise AssertionError("a model was built (or a demo started) despite a bad flag")

    monkeypatch.setattr(LlamaDecodeModel, "__init__", built)
    monkeypatch.setattr(TensorParallelLlama, "__init__", built)
    monkeypatch.setattr(cli, "run_demo", built)
    monkeypatch.setattr(cli, "run_tp_demo", built)


def test_the_no_work_fixture_catches_a_demo_that_builds_a_model(no_work):
    with pytest.raises(AssertionError, match="a model was built"):
        LlamaDecodeModel.random(cli.LlamaConfig.preset("tiny"), device="cpu")
    with pytest.raises(AssertionError, match="demo started"):
        main(["--steps", "1"])


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in captured.err and captured.out == ""
    assert err[0].startswith("graphguard-demo: error: "), err
    return err[0]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_a_one_line_usage_error_with_exit_code_2(flags, named, capsys, no_work):
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2
    assert named in _one_line_error(capsys)


def test_json_into_an_unwritable_path_is_refused_before_the_demo(tmp_path, capsys, no_work):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target in (blocker / "out.json", tmp_path):  # under a file; a folder
        with pytest.raises(SystemExit) as exc:
            main(["--json", str(target)])
        assert exc.value.code == 2
        assert "--json" in _one_line_error(capsys)
    assert blocker.read_text() == ""


def test_json_check_leaves_no_file_behind(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run_demo", lambda **kw: seen.append(kw["json_path"].exists()))
    path = tmp_path / "new" / "out.json"
    assert main(["--json", str(path)]) == 0
    assert seen == [False]


def test_good_flags_reach_the_demo_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "run_demo", lambda **kw: calls.append(kw))
    argv = ["--engine", "--max-batch", "4", "--sizes", "4, 1,2", "--chunk", "8", "--phases", "3,4"]
    assert main(argv) == 0
    assert calls[0]["sizes"] == [4, 1, 2] and calls[0]["chunk"] == 8
    assert calls[0]["phases"] == [3, 4] and calls[0]["max_batch"] == 4
    assert calls[0]["prompt_len"] == 16 and calls[0]["max_tokens"] is None


def test_version_names_the_demo_the_library_and_torch(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"graphguard {graphguard.__version__}" in out and torch.__version__ in out


def test_help_is_plain_text_without_markup(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: graphguard-demo" in out and "--max-batch" in out
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in out


def test_console_command_exits_2_with_one_line_and_no_traceback(fresh_interpreter):
    """``python -m graphguard_ref.cli --steps 0`` in a clean interpreter (the suite's one
    fresh interpreter runs it through ``runpy``, as ``-m`` does)."""
    proc = fresh_interpreter["commands"]["graphguard_ref.cli --steps 0"]
    assert proc["code"] == 2
    assert proc["stderr"].strip().splitlines() == [
        "graphguard-demo: error: argument --steps: must be an integer >= 1, got '0' "
        "(see graphguard-demo --help)"
    ]
