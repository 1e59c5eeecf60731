"""The README is run, not just read: its quick start and its Hugging Face snippet execute
verbatim on the CPU (tests/test_snippets.py, with every block marked runnable; the GPU runs
the same text, tests/gpu/test_readme_gpu.py), every relative link in it and in docs/
points at a file, and it stays a reference (at most 35 KB)."""

from __future__ import annotations

import pytest

from tests.readme_blocks import README, ROOT, quick_start, relative_links, runnable


def test_quick_start_is_marked_runnable_and_runs_on_a_cpu_as_written() -> None:
    """tests/test_snippets.py runs it (and every other block marked runnable)."""
    code = quick_start()
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code
    assert "gg.RecordingBackend()" in code, "the quick start must run on a CPU as written"
    assert code in {s.code for s in runnable()}


def test_every_public_name_is_documented_in_the_readme() -> None:
    """The README is the contract: each name of ``graphguard.__all__`` appears in it as
    code (backticks), and so does each option keyword."""
    import graphguard
    from graphguard.config import OPTION_NAMES

    text = README.read_text()
    missing = [n for n in graphguard.__all__ if n != "__version__" and f"`{n}" not in text]
    missing += [f"option {n}" for n in OPTION_NAMES if f"`{n}`" not in text]
    assert missing == []


def test_readme_is_a_reference_of_at_most_35_kb() -> None:
    size = len(README.read_bytes())
    assert size <= 35_000, f"README.md is {size} bytes; move detail into docs/ (limit 35,000)"


def _docs() -> list:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]


# Files another branch is adding; each entry fails this test once its file exists.
@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(doc) -> None:  # type: ignore[no-untyped-def]
    targets = [(doc.parent / t).resolve() for t in relative_links(doc)]
    broken = [str(t) for t in targets if not t.exists()]
    assert broken == [], f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


def test_relative_link_check_can_fail(tmp_path) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "x.md"
    doc.write_text("[a](missing.md) [b](https://example.com) [c](#anchor)\n```\n[d](no.md)\n```\n")
    assert relative_links(doc) == ["missing.md"]


def test_every_result_file_is_in_the_results_index() -> None:
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    missing = [
        p.name for p in results.iterdir() if p.name != "README.md" and f"`{p.name}`" not in index
    ]
    assert missing == [], f"bench/results/README.md does not index: {missing}"
