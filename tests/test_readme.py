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
