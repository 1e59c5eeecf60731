"""One fresh interpreter for every import-time rule (the ``fresh_interpreter`` fixture).

A rule about what ``import graphguard`` loads can only be checked in a process that has not
imported anything yet, and each such process costs seconds (torch's import). So one
subprocess, started with ``PYTHONPATH`` at the checkout's ``src`` and ``ref/src`` (a clean
clone needs nothing installed), runs every step the rules need, in order, and prints one
JSON object:

- ``import``: the ``graphguard*`` modules and the watched third-party ones loaded by
  ``import graphguard`` alone;
- ``capture``: the same after building, capturing and calling a GraphRunner and a
  PiecewiseRunner on the CPU (RecordingBackend);
- ``sanitize``: the same after building a runner with ``sanitize=True``;
- ``app_import``: the same after ``import graphguard_ref.serving_loop`` (the detector's own
  proof that it sees a reference-application module when one is loaded);
- ``commands``: exit code, stdout and stderr of ``python -m graphguard --version``,
  ``python -m graphguard`` and ``python -m graphguard_ref.cli --steps 0``, run through
  ``runpy`` as the interpreter runs them (after the module checks, so they change nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WATCHED = ("transformers", "torch._inductor")
"""Third-party modules the probe reports when loaded (beside graphguard's own)."""

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    WATCHED = {watched!r}

    def loaded():
        return sorted(
            m for m in sys.modules
            if m.split(".")[0] in ("graphguard", "graphguard_ref") or m in WATCHED
        )

    out = {{}}
    import graphguard as gg
    out["import"] = loaded()

    import torch
    from graphguard.piecewise import PiecewiseRunner

    @torch.library.custom_op("gg_probe::attn", mutates_args=())
    def attn(q: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ mem.t(), dim=-1) @ mem

    @attn.register_fake
    def _(q, mem):
        return torch.empty_like(q)

    mem, w = torch.randn(5, 8), torch.randn(8, 8)

    def step(x):
        return torch.tanh(x @ w) + 1

    def pw_step(x):
        return torch.ops.gg_probe.attn(torch.tanh(x @ w), mem) @ w

    x = torch.randn(3, 8)
    full = gg.GraphRunner(
        step, (torch.randn(1, 8),), sizes=[1, 2, 4], backend=gg.RecordingBackend(),
        progress=False,
    )
    full.capture()
    assert torch.allclose(full(x), step(x))
    pw = PiecewiseRunner(
        pw_step, (torch.randn(1, 8),), split_ops=[torch.ops.gg_probe.attn], sizes=[1, 2, 4],
        backend=gg.RecordingBackend(), progress=False,
    )
    with torch.no_grad():
        pw.capture()
        assert torch.allclose(pw(x), pw_step(x), atol=1e-5)
    out["pieces"] = len(pw.pieces)
    out["captured_sizes"] = [list(full.captured_sizes), list(pw.captured_sizes)]
    out["capture"] = loaded()

    gg.GraphRunner(
        step, (torch.randn(1, 8),), sizes=[1, 2], backend=gg.RecordingBackend(),
        progress=False, sanitize=True,
    )
    out["sanitize"] = loaded()

    import graphguard_ref.serving_loop  # noqa: F401
    out["app_import"] = loaded()

    def command(module, *args):
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.argv = [module, *args]
        code = 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        return {{"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}}

    out["commands"] = {{
        "graphguard --version": command("graphguard", "--version"),
        "graphguard": command("graphguard"),
        "graphguard_ref.cli --steps 0": command("graphguard_ref.cli", "--steps", "0"),
    }}
    print(json.dumps(out))
    """
)


def run_probe() -> dict[str, Any]:
    """Run :data:`SCRIPT` in a fresh interpreter; its JSON (asserts that it exited 0)."""
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT / "ref" / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop("GRAPHGUARD_SANITIZE", None)  # the rules are about the default
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(watched=WATCHED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def modules(loaded: list[str], *prefixes: str) -> list[str]:
    """The names in ``loaded`` that are one of ``prefixes`` or inside one."""
    return [m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes)]
