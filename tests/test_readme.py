"""The README's quick start runs on a CPU-only machine with two substitutions: the device
becomes "cpu" and the runner gets the recording backend (CPU emulation of capture and
replay). The GPU test runs it verbatim (tests/gpu/test_readme_gpu.py)."""

from __future__ import annotations

from tests.readme_blocks import quick_start


def test_quick_start_runs_on_cpu_with_the_recording_backend() -> None:
    code = quick_start()
    cpu = code.replace('device = "cuda"', 'device = "cpu"').replace(
        "fill_values=(0, 0))", "fill_values=(0, 0), backend=gg.RecordingBackend())"
    )
    assert cpu.count('device = "cpu"') == 1, "the quick start no longer sets device = 'cuda'"
    assert "RecordingBackend" in cpu, "the quick start's GraphRunner call changed shape"
    scope: dict[str, object] = {"__name__": "readme_quick_start"}
    exec(compile(cpu, "README.md:quick-start", "exec"), scope)
    report = scope["report"]
    assert report.captured == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[attr-defined]


def test_every_public_name_is_documented_in_the_readme() -> None:
    """The README is the contract: each name of ``graphguard.__all__`` appears in it as
    code (backticks), and so does each option keyword."""
    from pathlib import Path

    import graphguard
    from graphguard.config import OPTION_NAMES

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [n for n in graphguard.__all__ if n != "__version__" and f"`{n}" not in text]
    missing += [f"option {n}" for n in OPTION_NAMES if f"`{n}`" not in text]
    assert missing == []
