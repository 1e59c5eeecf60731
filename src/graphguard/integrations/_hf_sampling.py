"""Token selection on the device, the way transformers' ``generate`` does it.

Contract: :meth:`Sampler.select` takes float32 scores ``[B, V]`` and returns token ids
``[B]`` without a host sync: greedy is ``argmax``; sampling applies temperature, top-k,
top-p, then min-p exactly as transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` (same order, same
ops, ``min_tokens_to_keep=1``) and draws with ``torch.multinomial`` (from ``generator``
when given, else the global RNG, as ``generate`` does). :class:`EosTracker` keeps the
finished mask on the device and pads finished rows like ``generate``; only
:meth:`EosTracker.all_finished` reads the host. :class:`DecodeLoop` feeds one token per
row into the decode graphs; :func:`decode_tokens` is the loop of the three. The
settings arrive resolved and checked (:mod:`._hf_generate`); what is not applied was
refused there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphguard import GraphRunner
from graphguard.integrations._hf_generate import Settings


class Sampler:
    """Greedy or seeded sampling with HF's warper semantics (each warper skipped when
    HF would not add it: temperature None or 1, top-k None or 0, top-p None or 1,
    min-p None)."""

    def __init__(self, settings: Settings, generator: torch.Generator | None) -> None:
        self.do_sample = settings.do_sample
        t = settings.temperature
        self.temperature = t if t is not None and t != 1.0 else None
        self.top_k = settings.top_k or None
        p = settings.top_p
        self.top_p = p if p is not None and p < 1.0 else None
        self.min_p = settings.min_p
        self.generator = generator

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B]`` from float32 scores ``[B, V]`` (no host sync)."""
        if not self.do_sample:
            return torch.argmax(scores, dim=-1)
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.top_k is not None:
            k = min(self.top_k, scores.size(-1))
            kth = torch.topk(scores, k)[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p is not None:
            sorted_logits, sorted_idx = torch.sort(scores, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cum <= (1 - self.top_p)
            drop_sorted[..., -1:] = False
            drop = drop_sorted.scatter(1, sorted_idx, drop_sorted)
            scores = scores.masked_fill(drop, -float("inf"))
        if self.min_p is not None:
            probs = torch.softmax(scores, dim=-1)
            drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
            scores = scores.masked_fill(drop, -float("inf"))
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)


class EosTracker:
    """Finished rows on the device; the step at which each finished; HF's padding."""

    def __init__(
        self, batch: int, eos: Sequence[int], pad: int | None, steps: int, device: torch.device
    ) -> None:
        self.active = bool(eos)
        self.pad = pad
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((batch,), steps - 1, dtype=torch.long, device=device)

    def apply(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Pad rows already finished, then mark rows that emitted EOS now (no host sync)."""
        if not self.active:
            return tokens
        assert self.pad is not None
        tokens = torch.where(self.unfinished, tokens, self.pad)
        newly = self.unfinished & torch.isin(tokens, self.eos)
        self.finished_at.masked_fill_(newly, step)
        self.unfinished &= ~newly
        return tokens

    def all_finished(self) -> bool:
        """Host read (one sync): every row has emitted EOS."""
        return self.active and not bool(self.unfinished.any())

    def length(self, steps_run: int) -> int:
        """New tokens ``generate`` returns: up to the step the last row finished (one sync)."""
        if not self.active:
            return steps_run
        return min(steps_run, int(self.finished_at.max()) + 1)


class DecodeLoop:
    """Feeds one token per row into the decode graphs, zero-copy when a graph exists.

    The graph (a lazy runner captures it here) is prepared on the first decode step, not
    when the loop is built: the first token comes from the prefill, and a generate of one
    token needs no graph at all."""

    def __init__(self, runner: GraphRunner, next_pos: torch.Tensor, valid: torch.Tensor) -> None:
        self.runner = runner
        self.batch = valid.shape[0]
        self._start: tuple[torch.Tensor, torch.Tensor] | None = (next_pos, valid)
        self.graphed = False

    def _prepare(self, next_pos: torch.Tensor, valid: torch.Tensor) -> None:
        runner, batch = self.runner, self.batch
        self.graphed = runner.capture_for(batch) is not None  # lazy: captured here
        if self.graphed:
            self.ids, self.pos, kv_valid = runner.static_inputs(batch)
            self.pos.copy_(next_pos)
            kv_valid.copy_(valid)
        else:
            self.ids = torch.zeros((batch, 1), dtype=torch.long, device=valid.device)
            self.pos = next_pos.clone()
            self.valid = valid

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (float32) for ``tokens`` ``[B]``, then advance the positions."""
        if self._start is not None:
            self._prepare(*self._start)
            self._start = None
        self.ids.copy_(tokens[:, None])
        if self.graphed:
            logits: torch.Tensor = self.runner.replay(self.batch)
        else:
            logits = self.runner(self.ids, self.pos, self.valid)
        self.pos.add_(1)
        return logits


def decode_tokens(
    runner: GraphRunner,
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask2d: torch.Tensor,
    positions: torch.Tensor,
    settings: Settings,
    sampler: Sampler,
    *,
    new: int,
    max_cache_len: int,
    stop_check_every: int,
) -> torch.Tensor:
    """After the prefill's ``logits``: up to ``new`` tokens per row, each selected by
    ``sampler``, EOS tracked on the device (read on the host every ``stop_check_every``
    tokens), one decode replay per token. The prompts ``ids`` and their tokens
    ``[B, P + n]``: fewer than ``new`` when every row finished."""
    batch, prompt = ids.shape
    device = ids.device
    tokens = torch.empty((batch, prompt + new), dtype=torch.long, device=device)
    tokens[:, :prompt] = ids
    valid = torch.ones((batch, max_cache_len), dtype=torch.bool, device=device)
    valid[:, :prompt] = mask2d.bool()
    tracker = EosTracker(batch, settings.eos, settings.pad, new, device)
    decode = DecodeLoop(runner, positions[:, -1:] + 1, valid)
    steps = 0
    for t in range(new):
        nxt = tracker.apply(sampler.select(logits), t)
        tokens[:, prompt + t] = nxt
        steps = t + 1
        if steps == new:
            break
        if (t + 1) % stop_check_every == 0 and tracker.all_finished():
            break
        logits = decode(nxt)
    return tokens[:, : prompt + tracker.length(steps)]
