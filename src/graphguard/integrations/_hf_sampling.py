"""Token selection on the device, the way transformers' ``generate`` does it.

Contract: :meth:`Sampler.select` takes float32 scores ``[B, V]`` and returns token ids
``[B]`` without a host sync: greedy is ``argmax``; sampling applies temperature, top-k,
then top-p exactly as transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` (same order, same ops, ``min_tokens_to_keep=1``) and draws with
``torch.multinomial`` (from ``generator`` when given, else the global RNG, as
``generate`` does). :class:`EosTracker` keeps the finished mask on the device and pads
finished rows like ``generate``; only :meth:`EosTracker.all_finished` reads the host.
:class:`DecodeLoop` feeds one token per row into the decode graphs;
:func:`refuse_processors` refuses generation settings no graph applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphguard.errors import ConfigError
from graphguard.runner import GraphRunner


class Sampler:
    """Greedy or seeded sampling with HF's warper semantics."""

    def __init__(
        self,
        *,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
    ) -> None:
        if do_sample:
            if not temperature > 0:
                raise ConfigError(f"temperature must be > 0 when sampling, got {temperature!r}")
            if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
                raise ConfigError(f"top_k must be a non-negative int or None, got {top_k!r}")
            if top_p is not None and not 0.0 <= top_p <= 1.0:
                raise ConfigError(f"top_p must be in [0, 1] or None, got {top_p!r}")
        self.do_sample = do_sample
        self.temperature = float(temperature)
        self.top_k = top_k or None
        self.top_p = top_p if top_p is not None and top_p < 1.0 else None
        self.generator = generator

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B]`` from float32 scores ``[B, V]`` (no host sync)."""
        if not self.do_sample:
            return torch.argmax(scores, dim=-1)
        if self.temperature != 1.0:
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


_NEUTRAL = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "renormalize_logits": False,
}


def refuse_processors(gen: Any) -> None:
    """generate() would apply these from the generation config; we do not: refuse."""
    if gen is None:
        return
    active = [
        f"{k}={getattr(gen, k)!r}"
        for k, neutral in _NEUTRAL.items()
        if getattr(gen, k, neutral) not in (neutral, None, 0, 1.0, False, [], ())
    ]
    if active:
        raise ConfigError(
            "generate: model.generation_config enables logits processors that "
            f"GraphedCausalLM does not apply ({', '.join(active)}), so tokens would differ "
            "from model.generate; reset them (e.g. model.generation_config.repetition_penalty"
            " = 1.0) or use model.generate"
        )


class DecodeLoop:
    """Feeds one token per row into the decode graphs, zero-copy when a graph exists."""

    def __init__(self, runner: GraphRunner, next_pos: torch.Tensor, valid: torch.Tensor) -> None:
        self.runner = runner
        batch = valid.shape[0]
        self.batch = batch
        self.graphed = runner.padded_size(batch) is not None
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
        self.ids.copy_(tokens[:, None])
        if self.graphed:
            logits: torch.Tensor = self.runner.replay(self.batch)
        else:
            logits = self.runner(self.ids, self.pos, self.valid)
        self.pos.add_(1)
        return logits
