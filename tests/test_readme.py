"""The README is run, not just read, and stays a five-minute read: its quick start executes
verbatim on the CPU (tests/test_snippets.py, with every block marked runnable; the GPU runs
the same text, tests/gpu/test_readme_gpu.py), and so do its three Hugging Face lines on the
model of docs/hf.md's example. It holds at most 200 lines and no measurement: the numbers
live in docs/benchmarks.md, each beside its result file, and the contract in
docs/reference.md, which names every public name, option and error. Every relative link in
the README and docs/ points at a file, and every anchor at a heading."""

from __future__ import annotations

import re

import pytest

from tests.readme_blocks import (
    README,
    REFERENCE,
    ROOT,
    anchored_links,
    heading_anchors,
    hf_lines,
    quick_start,
    relative_links,
    runnable,
)

BENCHMARKS = ROOT / "docs" / "benchmarks.md"

MEASUREMENT = re.compile(
    r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*\s?(?:ms|µs|us|s|min|GiB|GB|MiB|MB|KB|%|x|tok/s)(?![\w])"
)
"""A number with a unit of time, memory, throughput or ratio: a measurement."""


def test_quick_start_is_marked_runnable_and_runs_on_a_cpu_as_written() -> None:
    """tests/test_snippets.py runs it (and every other block marked runnable)."""
    code = quick_start()
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code
    assert "gg.RecordingBackend()" in code, "the quick start must run on a CPU as written"
    assert code in {s.code for s in runnable()}


def test_the_readme_hugging_face_lines_are_three_calls() -> None:
    """Build, capture, generate (tests/test_snippets.py runs them on the guide's model)."""
    calls = [ln for ln in hf_lines().splitlines() if ln and not ln.startswith(("from ", "#"))]
    assert [c.split("(")[0] for c in calls] == [
        "g = GraphedCausalLM",
        "g.capture",
        "out = g.generate",
    ]


def test_every_public_name_option_and_error_is_in_the_reference() -> None:
    """docs/reference.md is the contract: each name of ``graphguard.__all__``, each option
    keyword and each error of ``graphguard.errors`` appears in it as code (backticks)."""
    import graphguard
    import graphguard.errors
    from graphguard.config import OPTION_NAMES

    text = REFERENCE.read_text()
    missing = [n for n in graphguard.__all__ if n != "__version__" and f"`{n}" not in text]
    missing += [f"option {n}" for n in OPTION_NAMES if f"`{n}`" not in text]
    missing += [f"error {n}" for n in graphguard.errors.__all__ if f"`{n}`" not in text]
    assert missing == [], f"docs/reference.md does not name {missing}"


def test_readme_is_a_five_minute_read_of_at_most_200_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail into docs/ (limit 200)"


@pytest.mark.parametrize("page", [README, REFERENCE], ids=lambda p: p.name)
def test_the_readme_and_the_reference_hold_no_measurement(page) -> None:  # type: ignore[no-untyped-def]
    """Numbers go to docs/benchmarks.md, where each one names its result file."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = [m.group(0) for m in MEASUREMENT.finditer(text)]
    assert found == [], f"{page.name} quotes measurements {found}: move them to docs/benchmarks.md"


def _unsourced(text: str) -> list[str]:
    """The first line of each paragraph or list item that quotes a measurement and links no
    file of bench/results/."""
    items = re.split(r"\n(?=- )|\n\n", re.sub(r"```.*?```", "", text, flags=re.S))
    return [
        item.strip().splitlines()[0]
        for item in items
        if MEASUREMENT.search(item) and "](../bench/results/" not in item
    ]


def test_every_measurement_in_benchmarks_names_its_result_file() -> None:
    unsourced = _unsourced(BENCHMARKS.read_text())
    assert unsourced == [], f"docs/benchmarks.md: numbers without a result file: {unsourced}"


def test_the_measurement_checks_can_fail() -> None:
    assert MEASUREMENT.findall("1.005x a graph, 2.55 ms, 10 µs, +8.3%, 2.30 GiB") == [
        "1.005x",
        "2.55 ms",
        "10 µs",
        "+8.3%",
        "2.30 GiB",
    ]
    assert MEASUREMENT.findall("torch 2.11 + CUDA 13, torch==2.13.0, sizes 1, 2, 4, 8") == []
    sourced = "- 2.55 ms ([`w.json`](../bench/results/w.json))"
    assert _unsourced(f"# M\n\n{sourced}\n- 0.25 ms, no file\n\nIt took 40 s.\n") == [
        "- 0.25 ms, no file",
        "It took 40 s.",
    ]


def _docs() -> list:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(doc) -> None:  # type: ignore[no-untyped-def]
    targets = [(doc.parent / t).resolve() for t in relative_links(doc)]
    broken = [str(t) for t in targets if not t.exists()]
    assert broken == [], f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_points_at_a_heading(doc) -> None:  # type: ignore[no-untyped-def]
    broken = [
        f"{page.name}#{anchor}"
        for page, anchor in anchored_links(doc)
        if page.exists() and anchor not in heading_anchors(page)
    ]
    assert broken == [], f"{doc.relative_to(ROOT)}: links to missing headings: {broken}"


def test_anchor_check_can_fail(tmp_path) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "x.md"
    doc.write_text("# The `state=` option: why\n\n[a](#the-state-option-why) [b](x.md#nope)\n")
    assert anchored_links(doc) == [(doc, "the-state-option-why"), (doc, "nope")]
    assert heading_anchors(doc) == {"the-state-option-why"}


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
