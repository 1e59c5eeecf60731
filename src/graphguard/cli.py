"""The library's own command, ``graphguard``: ``graphguard doctor`` and ``--version``.

``graphguard doctor`` answers the first question of a new machine: will capture work
here? It prints the versions against the tested range, what ``GRAPHGUARD_SANITIZE``
turns on, then runs the real lifecycle on a tiny step: on CUDA a real capture of three
sizes (replay compared with eager); on a CPU the same lifecycle under
:class:`~graphguard.backend.RecordingBackend`, checked event by event. Exit code 0 when
every check passes, 1 when one fails, 2 for a bad command line. The reference
application's demo is a separate command, ``graphguard-demo`` (distribution
``graphguard-ref``), so installing the library installs no model and no demo.
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

TESTED = "torch 2.11 + CUDA 13 (NVIDIA H200) and torch 2.13 (CPU); pyproject accepts torch >= 2.4"
TESTED_MINOR = ((2, 11), (2, 13))
"""torch (major, minor) versions the test suites ran on (see the README's Install)."""
MIN_TORCH = (2, 4)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report: what was checked, the finding, and whether it passed."""

    name: str
    ok: bool
    detail: str


def torch_version_check(version: str) -> Check:
    """``version`` (``torch.__version__``) against the minimum and the tested versions."""
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return Check("torch", False, f"{version}: not a version this check can read")
    if (major, minor) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return Check("torch", False, f"{version} is older than {need}; pip install 'torch>={need}'")
    tested = "tested" if (major, minor) in TESTED_MINOR else "untested (expected to work)"
    return Check("torch", True, f"{version}: {tested}; tested: {TESTED}")


def sanitize_check(environ: dict[str, str] | None = None) -> Check:
    """What ``GRAPHGUARD_SANITIZE`` makes of runners built without ``sanitize=``.

    Reads the value through the runner's own switch, so the doctor and the runners
    can never disagree about it.
    """
    from graphguard.config import sanitize_enabled
    from graphguard.errors import GraphGuardError

    env = os.environ if environ is None else environ
    raw = env.get("GRAPHGUARD_SANITIZE")
    shown = "unset" if raw is None else repr(raw)
    saved = os.environ.get("GRAPHGUARD_SANITIZE")
    try:
        if raw is None:
            os.environ.pop("GRAPHGUARD_SANITIZE", None)
        else:
            os.environ["GRAPHGUARD_SANITIZE"] = raw
        on = sanitize_enabled(None)
    except GraphGuardError as exc:
        return Check("GRAPHGUARD_SANITIZE", False, f"{shown}: {exc}")
    finally:
        if saved is None:
            os.environ.pop("GRAPHGUARD_SANITIZE", None)
        else:
            os.environ["GRAPHGUARD_SANITIZE"] = saved
    state = (
        "on for every runner built without sanitize=" if on else "off (sanitize=True turns it on)"
    )
    return Check("GRAPHGUARD_SANITIZE", True, f"{shown}: sanitizer {state}")


def _tiny_step(device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 32, generator=gen).to(device)
    w2 = torch.randn(32, 8, generator=gen).to(device)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w1) @ w2

    return step, torch.zeros(1, 16, device=device)


EXPECTED_EVENTS = [
    "hook",
    *("warmup", "synchronize") * 2,  # the output-layout probe at the two largest sizes
    "synchronize",
    *("warmup", "synchronize", "capture_begin", "capture_end"),  # 4: its warmup watched
    *("synchronize", "capture_begin", "capture_end"),  # 2: the probe's forward its warmup
    *("warmup", "synchronize", "capture_begin", "capture_end"),  # 1
    "replay",
]
"""The RecordingBackend lifecycle of :func:`capture_check` on a CPU, up to the first replay:
every uncaptured forward is followed by a synchronize, and every capture is preceded by
one. The probe's forward stands for a size's first warmup, except the first size's, which
is watched for undeclared writes (the check declares no ``state``)."""


def capture_check(device: torch.device) -> Check:
    """Capture a tiny step at sizes 1, 2, 4 and compare one padded replay with eager.

    On CUDA that is a real ``torch.cuda.CUDAGraph`` capture; elsewhere the lifecycle
    runs under :class:`~graphguard.backend.RecordingBackend` and its events (hook,
    warmup, synchronize, capture per size, largest first, then the replay) are checked.
    """
    from graphguard.backend import RecordingBackend
    from graphguard.phase import in_graph_preparation, is_capturing
    from graphguard.runner import GraphRunner

    cuda = device.type == "cuda"
    step, example = _tiny_step(device)
    backend = None if cuda else RecordingBackend()

    def note(kind: str) -> None:
        if backend is not None:
            backend.events.append((kind,))

    def watched(x: torch.Tensor) -> torch.Tensor:
        if in_graph_preparation() and not is_capturing():
            note("warmup")
        return step(x)

    what = "CUDA graph capture" if cuda else "RecordingBackend lifecycle (CPU emulation)"
    try:
        runner = GraphRunner(
            watched,
            (example,),
            sizes=[1, 2, 4],
            before_capture=[lambda _sizes: note("hook")],
            progress=False,
            name="doctor.step",
            backend=backend,
        )
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.capture()
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(device)
            got = runner(x).clone()
            want = step(x)
        seconds = time.perf_counter() - t0
        runner.release()
    except Exception as exc:  # the doctor reports any failure as a finding
        return Check("capture", False, f"{what} failed: {type(exc).__name__}: {exc}")
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        diff = float((got - want).abs().max())
        return Check("capture", False, f"{what}: replay differs from eager (max |diff| {diff:.3g})")
    if backend is not None:
        events = [e[0] for e in backend.events]
        events = events[: events.index("replay") + 1] if "replay" in events else events
        if events != EXPECTED_EVENTS:
            return Check("capture", False, f"{what}: lifecycle out of order: {events}")
        order = (
            "hooks (the layout probe's forwards at 4 and 2), synchronize, then per size "
            "4, 2, 1: warmup (at 2 the probe's), synchronize, capture"
        )
        return Check("capture", True, f"{what}: {order}; padded replay of 3 rows == eager")
    return Check(
        "capture",
        True,
        f"{what} of sizes 4, 2, 1 in {seconds:.2f} s; padded replay of 3 rows == eager",
    )


def doctor(out: Callable[[str], None] = print) -> int:
    """Print the report; 0 when every check passed, else 1."""
    import graphguard

    out(f"graphguard {graphguard.__version__} ({os.path.dirname(graphguard.__file__)})")
    out(f"python {platform.python_version()} ({sys.executable})")
    checks = [torch_version_check(torch.__version__), sanitize_check()]
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        checks.append(
            Check(
                "CUDA",
                True,
                f"{torch.version.cuda}, {torch.cuda.device_count()} device(s); using "
                f"{torch.cuda.get_device_name(device)} (sm {cap})",
            )
        )
    else:
        device = torch.device("cpu")
        checks.append(
            Check(
                "CUDA",
                True,
                "not available: CUDA graphs need an NVIDIA GPU; runners take "
                "backend=RecordingBackend() to test the lifecycle here, mode='none' runs eagerly",
            )
        )
    checks.append(capture_check(device))
    for c in checks:
        out(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    out(
        f"doctor: {len(checks) - len(failed)}/{len(checks)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    """The ``graphguard`` parser (``--version``, ``doctor``)."""
    import graphguard

    ap = argparse.ArgumentParser(
        prog="graphguard",
        description="graphguard: safe CUDA-graph capture and replay for PyTorch inference.",
        epilog="The reference application's demo is its own command: graphguard-demo.",
    )
    ap.add_argument("--version", action="version", version=f"graphguard {graphguard.__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser(
        "doctor",
        help="versions, GRAPHGUARD_SANITIZE, and whether capture works on this machine",
        description="Print versions against the tested range and GRAPHGUARD_SANITIZE's "
        "effect, then capture a tiny step (CUDA) or run the lifecycle under the "
        "RecordingBackend (CPU) and compare replay with eager. Exit 0 if every check passes.",
    )
    return ap


def _refuse_unknown(ap: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Name a mistyped option or command before argparse's generic "COMMAND is required".

    argparse sets an unknown option before the command aside and then reports only the
    missing command (``graphguard --versoin``); and ``graphguard demo`` is the reference
    app's command, ``graphguard-demo``, which this parser cannot know.
    """
    known = ["-h", "--help", "--version"]  # build_parser's options
    for arg in argv:
        if arg == "--":
            return
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            if flag not in known:
                near = difflib.get_close_matches(flag, known, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                ap.error(f"unknown option {flag}{hint}; options: {', '.join(known)}")
            continue
        if arg == "demo":
            ap.error(
                "the demo is its own command, graphguard-demo, from the reference app "
                "(distribution graphguard-ref: pip install -e ref in a graphguard checkout)"
            )
        return  # the command: argparse checks it and what follows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``graphguard`` console script and ``python -m graphguard``."""
    ap = build_parser()
    _refuse_unknown(ap, sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        return doctor()
    raise AssertionError(f"unhandled command {args.cmd!r}")  # pragma: no cover - argparse


__all__ = [
    "Check",
    "build_parser",
    "capture_check",
    "doctor",
    "main",
    "sanitize_check",
    "torch_version_check",
]
