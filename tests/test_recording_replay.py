"""RecordingBackend replays what CUDA replays (issue 29): a step whose output is an
expanded view (stride 0, elements sharing memory) replays equal to eager on the CPU, as
it does on a GPU, instead of torch's raw "more than one element of the written-to
tensor refers to a single memory location"."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend


def _runner(step, lin: torch.nn.Module) -> tuple[gg.GraphRunner, RecordingBackend]:
    backend = RecordingBackend()
    r = gg.GraphRunner(
        step,
        (torch.zeros(1, 4),),
        sizes=[1, 2, 4],
        backend=backend,
        progress=False,
        options=gg.CaptureOptions(weights=lin),
    )
    with torch.no_grad():
        r.capture()
    return r, backend


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_an_expanded_view_output_replays_equal_to_eager(n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = lin(x)
        return h.unsqueeze(1).expand(-1, 3, -1), h * 2, (h + 1)[:, None].expand(-1, 2, -1)

    r, backend = _runner(step, lin)
    with torch.no_grad():
        for seed in range(3):  # every replay writes fresh values into the captured views
            x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
            got = r(x)
            want = step(x)
            assert [g.shape for g in got] == [w.shape for w in want]
            for g, w in zip(got, want):
                assert torch.equal(g, w)
    assert got[0].stride()[1] == 0  # still the expanded view, as a graph's output is
    assert ("replay", 4 if n > 2 else n) in backend.events


def test_a_plain_output_replays_equal_to_eager():
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(lin(x))

    r, backend = _runner(step, lin)
    with torch.no_grad():
        for n in (1, 3, 4):
            x = torch.randn(n, 4)
            assert torch.equal(r(x), step(x))
    assert backend.names().count("replay") == 3
