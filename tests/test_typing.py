"""The runner keywords are typed: mypy rejects a misspelt one at the call site.

Runs mypy (a dev dependency) on a small file of calls; each misspelt keyword must be
reported on its own line, and the correct call beside them must pass.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

CALLS = textwrap.dedent(
    """
    import torch
    import graphguard as gg

    x = (torch.zeros(2),)
    gg.GraphRunner(lambda t: t, x, sizess=[1, 2])
    gg.PiecewiseRunner(lambda t: t, x, split_ops=[], warmup_iter=2)
    gg.CaptureOptions(progres=False)
    gg.GraphRunner(lambda t: t, x, sizes=[1, 2], progress="no")
    gg.GraphRunner(lambda t: t, x, sizes=[1, 2], progress=False, fill_values=0)
    gg.PiecewiseRunner(lambda t: t, x, split_ops=[], options=gg.CaptureOptions(sizes=[1]))
    """
)


def test_mypy_rejects_misspelt_and_mistyped_keywords(tmp_path: Path) -> None:
    src = tmp_path / "calls.py"
    src.write_text(CALLS)
    out, err, _ = mypy_api.run(
        [str(src), "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--strict"]
    )
    errors = [line for line in out.splitlines() if ": error:" in line]
    by_line = {int(line.split(":")[1]): line for line in errors}
    assert 'Unexpected keyword argument "sizess" for "GraphRunner"' in by_line[6], out + err
    assert '"warmup_iter" for "PiecewiseRunner"' in by_line[7]
    assert '"progres" for "CaptureOptions"' in by_line[8]
    assert 'Argument "progress" to "GraphRunner" has incompatible type "str"' in by_line[9]
    assert set(by_line) == {6, 7, 8, 9}, out  # the correct calls pass
