"""The first ten minutes on a GPU: ``graphguard doctor`` captures for real, and the demo
prints no warning (neither graphguard's nor torch's), reports the process's first
forward apart from capture, and prints each summary line once.

Every run is a fresh interpreter: torch's sync-debug notice is a ``TORCH_WARN_ONCE``,
so only the process's first ``set_sync_debug_mode`` call can show it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
NOTICE = "Synchronization debug mode is a prototype"


def _python(*args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT / "ref" / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONWARNINGS"] = "always"  # every warning shown, none deduplicated away
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


CAPTURE = textwrap.dedent(
    """
    import torch
    import graphguard as gg
    {first}
    w = torch.randn(16, 16, device="cuda")
    r = gg.GraphRunner(lambda x: x @ w, (torch.zeros(1, 16, device="cuda"),), sizes=[1, 2],
                       progress=False)
    with torch.inference_mode():
        r.capture()
        x = torch.randn(2, 16, device="cuda")
        torch.testing.assert_close(r(x), x @ w)
    print("captured")
    """
)


def test_torchs_notice_shows_when_the_mode_is_set_unguarded():
    """The detector can fail: setting the mode directly, first in the process, warns."""
    code = CAPTURE.format(
        first='torch.cuda.set_sync_debug_mode("error")\ntorch.cuda.set_sync_debug_mode("default")'
    )
    proc = _python("-c", code)
    assert NOTICE in proc.stderr


def test_capture_shows_no_sync_debug_notice():
    proc = _python("-c", CAPTURE.format(first=""))
    assert "captured" in proc.stdout
    assert NOTICE not in proc.stderr, proc.stderr[-2000:]


def test_doctor_captures_on_the_gpu_and_passes():
    proc = _python("-m", "graphguard", "doctor")
    assert "[ok] capture: CUDA graph capture of sizes 4, 2, 1" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "doctor: 4/4 checks passed"
    assert NOTICE not in proc.stderr


def test_decode_demo_prints_no_warning_startup_apart_and_the_summary_once():
    proc = _python(
        "-m",
        "graphguard_ref.cli",
        "--preset",
        "tiny",
        "--max-batch",
        "16",
        "--context",
        "128",
        "--steps",
        "40",
    )
    both = proc.stdout + proc.stderr
    assert "WARNING" not in both and NOTICE not in both, both[-3000:]
    lines = proc.stdout.splitlines()
    startup = [i for i, line in enumerate(lines) if line.startswith("start-up: ")]
    summary = [i for i, line in enumerate(lines) if line.startswith("captured ")]
    assert len(startup) == 1 and len(summary) == 1 and startup[0] < summary[0], proc.stdout
    assert "captured 5 graphs" in lines[summary[0]]  # capture_sizes(16): 1, 2, 4, 8, 16
    check = next(line for line in lines if line.startswith("check vs eager"))
    agreement = float(check.split("argmax agreement ")[1].split("%")[0])
    assert "over 40 steps" in check and agreement >= 99.0, check


def test_engine_demo_prints_no_warning():
    proc = _python(
        "-m",
        "graphguard_ref.cli",
        "--preset",
        "tiny",
        "--max-batch",
        "8",
        "--context",
        "64",
        "--steps",
        "30",
        "--mode",
        "full_and_piecewise",
        "--spec-tokens",
        "2",
    )
    both = proc.stdout + proc.stderr
    assert "WARNING" not in both and NOTICE not in both, both[-3000:]
    assert "check vs eager over 30 steps" in proc.stdout
