"""The library's own command, ``graphguard`` (``doctor``, ``--version``), the packaging
that keeps the reference app out of the library's wheel, and the sync-debug notice."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import graphguard
import graphguard.cli as gcli
from graphguard import _unwind
from graphguard.cli import capture_check, doctor, main, sanitize_check, torch_version_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_doctor_on_a_cpu_runs_the_recorded_lifecycle_and_passes(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"graphguard {graphguard.__version__}" in out
    assert "[ok] torch: " in out and "[ok] GRAPHGUARD_SANITIZE: " in out
    assert "[ok] CUDA: not available" in out
    assert "[ok] capture: RecordingBackend lifecycle" in out
    assert "per size 4, 2, 1: warmup (at 2 the probe's), synchronize, capture" in out
    assert out.strip().splitlines()[-1] == "doctor: 4/4 checks passed"


def test_capture_check_fails_when_replay_differs_from_eager(monkeypatch):
    calls = []

    def drifting(device):
        def step(x):
            calls.append(1)
            return x * len(calls)  # every call differs: replay cannot equal eager

        return step, torch.zeros(1, 16, device=device)

    monkeypatch.setattr(gcli, "_tiny_step", drifting)
    check = capture_check(torch.device("cpu"))
    assert not check.ok and "replay differs from eager" in check.detail


def test_capture_check_reports_a_capture_that_raises(monkeypatch):
    def broken(device):
        def step(x):
            raise RuntimeError("kernel exploded")

        return step, torch.zeros(1, 16, device=device)

    monkeypatch.setattr(gcli, "_tiny_step", broken)
    check = capture_check(torch.device("cpu"))
    assert not check.ok and "kernel exploded" in check.detail


def test_doctor_exits_1_and_names_the_failed_check(monkeypatch, capsys):
    monkeypatch.setattr(gcli, "capture_check", lambda d: gcli.Check("capture", False, "boom"))
    assert doctor() == 1
    out = capsys.readouterr().out
    assert "[FAIL] capture: boom" in out and "failed: capture" in out


@pytest.mark.parametrize(
    ("version", "ok", "says"),
    [
        ("2.13.0+cpu", True, "tested"),
        ("2.11.0+cu130", True, "tested"),
        ("2.12.1", True, "untested"),
        ("2.3.1", False, "older than 2.4"),
        ("nightly", False, "can read"),
    ],
)
def test_torch_version_against_the_tested_range(version, ok, says):
    check = torch_version_check(version)
    assert check.ok is ok and says in check.detail


def test_sanitize_check_reads_the_runners_switch_and_leaves_the_environment(monkeypatch):
    monkeypatch.setenv("GRAPHGUARD_SANITIZE", "keep-me")
    assert "off" in sanitize_check({}).detail and "unset" in sanitize_check({}).detail
    on = sanitize_check({"GRAPHGUARD_SANITIZE": "1"})
    assert on.ok and "'1'" in on.detail and "sanitizer on" in on.detail
    assert os.environ["GRAPHGUARD_SANITIZE"] == "keep-me"


def test_python_m_graphguard_version_and_a_missing_command(fresh_interpreter):
    """``python -m graphguard`` in a clean interpreter (the suite's one fresh interpreter
    runs both commands through ``runpy``, as ``-m`` does)."""
    commands = fresh_interpreter["commands"]
    version = commands["graphguard --version"]
    assert version["code"] == 0
    assert version["stdout"].strip() == f"graphguard {graphguard.__version__}"
    bare = commands["graphguard"]
    assert bare["code"] == 2 and "COMMAND" in bare["stderr"] and "Traceback" not in bare["stderr"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--versoin"], "unknown option --versoin (did you mean --version?)"),
        (["-x"], "unknown option -x; options: -h, --help, --version"),
        (["--versoin", "doctor"], "unknown option --versoin (did you mean --version?)"),
        (["demo"], "the demo is its own command, graphguard-demo, from the reference app"),
        (["dcotor"], "invalid choice: 'dcotor'"),
        (["doctor", "--fast"], "unrecognized arguments: --fast"),
    ],
)
def test_a_mistyped_option_or_command_is_named_with_what_to_type(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert "arguments are required: COMMAND" not in err


# ------------------------------------------------------------------ packaging


def _pyproject(path: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")
    return dict(tomllib.loads(path.read_text()))


def test_the_library_wheel_ships_only_the_library_and_its_command():
    setuptools = pytest.importorskip("setuptools")
    lib = _pyproject(ROOT / "pyproject.toml")
    found = lib["tool"]["setuptools"]["packages"]["find"]
    (where,) = found["where"]
    packages = setuptools.find_packages(where=ROOT / where, include=found["include"])
    assert "graphguard" in packages and "graphguard.sanitizer" in packages
    assert not [p for p in packages if p.startswith("graphguard_ref")]
    assert lib["project"]["scripts"] == {"graphguard": "graphguard.cli:main"}


def test_the_reference_app_is_its_own_distribution_with_its_own_command():
    setuptools = pytest.importorskip("setuptools")
    ref = _pyproject(ROOT / "ref" / "pyproject.toml")
    assert ref["project"]["name"] == "graphguard-ref"
    assert ref["project"]["dependencies"] == [f"graphguard=={graphguard.__version__}"]
    found = ref["tool"]["setuptools"]["packages"]["find"]
    where = ROOT / "ref" / found["where"][0]
    packages = setuptools.find_packages(where=where, include=found["include"])
    assert "graphguard_ref" in packages and "graphguard_ref.demo" in packages
    assert all(p.startswith("graphguard_ref") for p in packages)
    assert ref["project"]["scripts"] == {"graphguard-demo": "graphguard_ref.cli:main"}


def test_the_readme_test_command_installs_only_what_the_tests_need_and_ci_runs_it():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    test_cmd = next(c for c in commands if "pytest" in c)
    assert '-e ".[test]" -e ref' in test_cmd and "-n auto" in test_cmd
    assert test_cmd in ci.splitlines()
    assert '-e ".[dev]" -e ref' in ci  # CI also lints and type-checks
    assert any("graphguard-demo" in c and "-e ref" in c for c in commands)
    extras = _pyproject(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("<")[0].split("=")[0] for req in extras["test"]}
    assert {"pytest", "pytest-xdist", "hypothesis", "transformers"} <= names
    assert not names & {"ruff", "mypy", "matplotlib"}  # the linters and plots are not tests
    assert extras["dev"] == ["graphguard[test,lint,plot]"]


def test_the_cuda_extra_brings_cuda_bindings_and_the_readme_install_names_it():
    extras = _pyproject(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    for extra in ("cuda", "provenance"):  # provenance: the name its log line gives
        assert any(req.startswith("cuda-bindings") for req in extras[extra]), extra
    install = (ROOT / "README.md").read_text().split("\n## Install\n", 1)[1].split("\n## ")[0]
    assert '".[cuda]"' in install and "cuda-bindings" in install
    assert "download.pytorch.org/whl/cpu" in install  # how to get the CPU build of torch


# ------------------------------------------------------------------ sync-debug notice


def test_capture_sync_guard_swallows_torchs_prototype_notice_and_restores_the_mode(monkeypatch):
    mode = {"now": 0}
    notice = (
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations"
    )

    def set_mode(m):
        warnings.warn(notice, UserWarning, stacklevel=2)  # what torch's C++ TORCH_WARN_ONCE does
        mode["now"] = {"error": 2}.get(m, m)

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"], raising=False)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _unwind.sync_debug_error():
            assert mode["now"] == 2
            warnings.warn("a warning of the step itself", UserWarning, stacklevel=1)
    assert mode["now"] == 0
    assert [str(w.message) for w in seen] == ["a warning of the step itself"]
