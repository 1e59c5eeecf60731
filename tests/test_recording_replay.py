"""RecordingBackend replays what CUDA replays (issue 29): a step whose output is an
expanded view (stride 0, elements sharing memory) replays equal to eager on the CPU, as
it does on a GPU, instead of torch's raw "more than one element of the written-to
tensor refers to a single memory location".

A padded replay runs the step at the graph's size: it is compared bit for bit with eager
at that size (the real rows, then the fill value 0), and with eager at the batch's own
size only to float round-off (a BLAS may sum 3 and 4 rows in another order: MKL on
AVX-512 does)."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.backend import RecordingBackend


def _eager_at_graph_size(step, x: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """The step at the graph's size on the rows a padded replay sees, cut to the batch."""
    n = x.shape[0]
    out = step(torch.cat([x, x.new_zeros(size - n, *x.shape[1:])]))
    return tuple(o[:n] for o in (out if isinstance(out, tuple) else (out,)))


def _assert_replay_is_eager(got, step, x: torch.Tensor, size: int) -> None:
    got = got if isinstance(got, tuple) else (got,)
    at_size = _eager_at_graph_size(step, x, size)
    want = step(x)
    want = want if isinstance(want, tuple) else (want,)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, a, w in zip(got, at_size, want):
        assert torch.equal(g, a)  # the graph's own arithmetic, on any CPU
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)  # eager at n rows


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
    size = 4 if n > 2 else n
    with torch.no_grad():
        for seed in range(3):  # every replay writes fresh values into the captured views
            x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
            got = r(x)
            _assert_replay_is_eager(got, step, x, size)
    assert got[0].stride()[1] == 0  # still the expanded view, as a graph's output is
    assert ("replay", size) in backend.events


def test_a_plain_output_replays_equal_to_eager():
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(lin(x))

    r, backend = _runner(step, lin)
    with torch.no_grad():
        for n, size in ((1, 1), (3, 4), (4, 4)):
            x = torch.randn(n, 4)
            _assert_replay_is_eager(r(x), step, x, size)
    assert backend.names().count("replay") == 3
