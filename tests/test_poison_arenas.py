"""NaN-poisoned arenas at lock (``Canary(poison_arenas=...)``, on with ``sanitize=True``), CPU.

Two planted scratch bugs, each a small step that really does it, pass ``verify()`` and
the canary while the arena holds zeros (by luck: zeros, or values made from the harmless
fill values) and are caught once capture fills the arena with NaN at its lock:

- ``past``: the step takes ``n + 1`` scratch rows, writes ``n`` and reads row ``n`` (an
  off-by-one). The graph at the padded size reads a row nothing wrote since the lock;
  eager at the real batch reads a row the graph's padded row just wrote.
- ``residue``: the step accumulates into scratch it expects to be zero and zeroes it at
  the end, "for the next call" (a second user of the arena breaks that). The first
  replay after the lock reads NaN; eager, right after it, reads the zeros it left.

Both paths share the arena, so scratch that neither writes reads NaN on both and compares
equal; the poison shows reads that differ between the replay and eager, as above.
"""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard import phase
from graphguard.canary import poisons_arenas
from graphguard.errors import ConfigError, DivergenceError

D = 4
SIZES = [2, 4, 8]
ARENA = 4096  # bytes; the steps use at most (9, 4) float32 = 144 of them


class Scratch(torch.nn.Module):
    """A step drawing its scratch from its own arena; ``bug`` plants one (see the module)."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g))
        self.bug = bug
        self.ws = gg.Workspace(f"scratch-{bug}", device="cpu")
        self.ws.reserve(ARENA)
        assert self.ws.buffer is not None
        self.ws.buffer.zero_()  # the luck: fresh memory that happens to be zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.bug == "past":
            (tmp,) = self.ws.get(((n + 1, D), x.dtype))
            tmp[:n] = torch.tanh(x @ self.w)
            return tmp[:n] + tmp[n]  # row n: not written by this call
        (acc,) = self.ws.get(((n, D), x.dtype))
        if self.bug != "residue":
            acc.zero_()  # the correct step zeroes before it accumulates
        acc.add_(x @ self.w)
        out = torch.tanh(acc)
        acc.zero_()  # "left clean for the next call"
        return out


def make(m: Scratch, **kw) -> gg.GraphRunner:
    kw.setdefault("sizes", SIZES)
    kw.setdefault("backend", gg.RecordingBackend())
    kw.setdefault("progress", False)
    kw.setdefault("state", [])
    r = gg.GraphRunner(m, (torch.randn(8, D),), workspaces=[m.ws], **kw)
    with torch.no_grad():
        r.capture()
    return r


def x_(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def nan_bytes(ws: gg.Workspace) -> float:
    """The share of the arena's float32 words that are NaN."""
    assert ws.buffer is not None
    return float(torch.isnan(ws.buffer.view(torch.float32)).float().mean())


# ------------------------------------------------------------------ the switch


def test_the_option_is_checked_and_defaults_to_the_sanitizer():
    with pytest.raises(ConfigError, match=r"poison_arenas=.*True, False or None"):
        gg.Canary(poison_arenas=1)  # type: ignore[arg-type]
    assert poisons_arenas(None, False) is False
    assert poisons_arenas(None, True) is True
    assert poisons_arenas(gg.Canary(), True) is True
    assert poisons_arenas(gg.Canary(), False) is False
    assert poisons_arenas(gg.Canary(poison_arenas=True), False) is True
    assert poisons_arenas(gg.Canary(poison_arenas=False), True) is False


def test_the_arena_holds_nan_after_capture_only_when_asked():
    for kw, poisoned in (
        ({}, False),
        ({"canary": gg.Canary()}, False),
        ({"canary": gg.Canary(poison_arenas=True)}, True),
        ({"sanitize": True}, True),
        ({"sanitize": True, "canary": gg.Canary()}, True),
        ({"sanitize": True, "canary": gg.Canary(poison_arenas=False)}, False),
    ):
        m = Scratch()
        make(m, **kw)
        assert m.ws.locked
        assert nan_bytes(m.ws) == (1.0 if poisoned else 0.0), kw
        if poisoned:  # every byte, in every float view the arena hands out
            assert bool((m.ws.buffer == 0xFF).all())
            for dtype in (torch.float16, torch.bfloat16, torch.float64):
                assert bool(torch.isnan(m.ws.buffer.view(dtype)).all()), dtype


def test_a_profiling_capture_does_not_poison_and_a_recapture_poisons_again():
    m = Scratch()
    r = gg.GraphRunner(
        m,
        (torch.randn(8, D),),
        sizes=SIZES,
        backend=gg.RecordingBackend(),
        progress=False,
        state=[],
        workspaces=[m.ws],
        canary=gg.Canary(poison_arenas=True),
    )
    with torch.no_grad():
        r.estimate_graph_memory()
        assert not m.ws.locked and nan_bytes(m.ws) == 0.0
        r.capture()
        assert nan_bytes(m.ws) == 1.0
        m.ws.buffer.zero_()
        r.recapture(reason="weights reloaded")  # unlocked on purpose, locked again
    assert m.ws.locked and nan_bytes(m.ws) == 1.0


def test_a_lazy_runner_poisons_at_its_stage_and_never_while_serving():
    m = Scratch()
    r = make(m, lazy=True, canary=gg.Canary(poison_arenas=True))
    assert r.captured_sizes == () and m.ws.locked and nan_bytes(m.ws) == 1.0
    assert m.ws.buffer is not None
    m.ws.buffer.fill_(7)  # a marker: what serving left in the arena
    with torch.no_grad():
        for _ in range(2):  # each size's first call, then its capture
            r(x_(3))  # captures size 4, arenas locked: no second fill
            r(x_(8))
    assert r.captured_sizes == (4, 8)
    assert bool((m.ws.buffer[1024:] == 7).all())  # beyond any view: untouched


def test_poison_refuses_inside_a_capture_and_reports_an_empty_arena():
    ws = gg.Workspace("fresh", device="cpu")
    assert ws.poison() is False and ws.buffer is None
    ws.reserve(64)
    with (
        phase.enter(phase.Phase.CAPTURE, owner="test"),
        pytest.raises(ConfigError, match=r"'fresh'.*being captured.*recorded into the graph"),
    ):
        ws.poison()
    assert ws.poison() is True and bool((ws.buffer == 0xFF).all())


# -------------------------------------------------------------- the planted bugs


@pytest.mark.parametrize("bug", ["past", "residue"])
def test_a_scratch_read_passes_verify_on_zeros_and_is_caught_with_poison(bug):
    calm = make(Scratch(bug))
    with torch.no_grad():
        assert calm.verify().ok  # by luck: the scratch it reads holds zeros
    poisoned = make(Scratch(bug), canary=gg.Canary(poison_arenas=True))
    with torch.no_grad(), pytest.raises(DivergenceError, match="diverges from eager"):
        poisoned.verify()


def test_past_the_rows_read_is_caught_at_every_check_and_not_without_poison():
    """The row past the real ones at size 4 is never written by a size-4 replay or an
    eager batch of 3, so the NaN stays: every check diverges, not only the first."""
    calm = make(Scratch("past"), canary=gg.Canary(every=1))
    poisoned = make(Scratch("past"), canary=gg.Canary(every=1, poison_arenas=True))
    with torch.no_grad():
        for i in range(5):
            calm(x_(3, seed=i))
            poisoned(x_(3, seed=i))
    assert (calm.canary_stats()[4].checks, calm.canary_stats()[4].divergences) == (5, 0)
    st = poisoned.canary_stats()[4]
    assert (st.checks, st.divergences) == (5, 5)
    assert st.last is not None and st.last.sizes[0].batch == 3 and st.max_abs == float("inf")


def test_residue_read_is_caught_at_the_first_replay_after_the_lock():
    """With ``sanitize=True`` (poison on by default) the check's shadow replay with
    poisoned padding is the first replay after the lock, so it is the one that reads NaN."""
    poisoned = make(Scratch("residue"), sanitize=True, canary=gg.Canary(every=1))
    with torch.no_grad():
        poisoned(x_(3))
        poisoned(x_(3, seed=1))
    st = poisoned.canary_stats()[4]
    assert (st.checks, st.divergences) == (2, 1)  # then the step's own zeroing hides it
    assert st.last is not None and st.last.sizes[0].max_abs == float("inf")


def test_a_correct_step_is_not_flagged_with_poison():
    r = make(Scratch(), canary=gg.Canary(every=1, on_divergence="raise", poison_arenas=True))
    assert nan_bytes(r.options.workspaces[0]) == 1.0
    with torch.no_grad():
        assert r.verify().ok  # its 6 replays (2 per size) are checked calls too
        for i, n in enumerate([1, 3, 4, 5, 8, 2, 7]):
            out = r(x_(n, seed=i))
            assert not torch.isnan(out).any()
    stats = r.canary_stats()
    assert sum(s.checks for s in stats.values()) == 6 + 7
    assert all(s.divergences == 0 for s in stats.values())
    assert max(s.max_abs for s in stats.values()) == 0.0  # same kernels, same values
