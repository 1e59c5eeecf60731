"""A small serving loop over ``LlamaDecodeModel.mixed_step``, in every graph mode.

Contract: requests prefill their prompt in chunks, then decode one token or verify
``k`` prompt-lookup drafts per step (``q = 1 + k``). A step whose requests all
decode/verify has a uniform key (:meth:`BatchKey.decode`), any prefill chunk makes it
mixed (:meth:`BatchKey.mixed`); :func:`make_batch` refuses rows that disagree with the
tokens. :func:`build_dispatcher` wires FULL graphs (GraphRunner), PIECEWISE graphs
(PiecewiseRunner split at ``graphguard_ref::mixed_attention``) and eager under one
Dispatcher. Drafts are accepted while they equal the greedy token, so the emitted text
is exactly plain greedy decoding's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import graphguard as gg
from graphguard.backend import GraphBackend
from graphguard.config import Mode
from graphguard.dispatch import Dispatcher
from graphguard.errors import ConfigError
from graphguard_ref.batches import Rows, StepBatch, make_batch
from graphguard_ref.llama import MIXED_ATTENTION_OP, LlamaDecodeModel

LOOKUP_WINDOW = 256
"""How many of a request's latest tokens prompt lookup searches (bounds host time per step)."""
INPUT_NAMES = ("token_ids", "positions", "slots")


# ----------------------------------------------------------------------------- wiring


def build_dispatcher(
    model: LlamaDecodeModel,
    mode: Mode | str,
    *,
    max_tokens: int,
    query_len: int = 1,
    full_sizes: Sequence[int] | None = None,
    piecewise_sizes: Sequence[int] | None = None,
    full_mixed: bool = False,
    make_backend: Callable[[], GraphBackend] | None = None,
    progress: bool = False,
    name: str = "mixed_step",
) -> Dispatcher:
    """A dispatcher over ``model.mixed_step`` for ``mode`` (nothing captured yet):
    :func:`graphguard.build_dispatcher` with the reference model's inputs and split op.

    Args:
        max_tokens: the largest batch (tokens) the engine schedules.
        query_len: tokens per request of the uniform batches the FULL graphs serve:
            1 for decode, ``1 + k`` for speculative verify with ``k`` drafts.
        full_sizes, piecewise_sizes: capture sizes (defaults: the plan's ladders,
            FULL sizes multiples of ``query_len``).
        full_mixed: mode FULL only: let mixed batches replay the FULL graphs
            (``mixed_step``'s attention is capturable for any layout, so this is sound
            for the reference model; off by default, as for an engine whose ragged
            attention does not graph).
        make_backend: graph backend factory, one per runner (default: CUDA);
            :class:`~graphguard.backend.RecordingBackend` runs the plumbing on a CPU.

    Call ``dispatcher.capture()`` (prints nothing; ``dispatcher.plan.table()`` is the
    resolved plan), then ``dispatcher(key, token_ids, positions, slots)``; release the
    graphs with :func:`release`.
    """
    m = Mode.parse(mode)
    return gg.build_dispatcher(
        model.mixed_step,
        model.example_inputs(1),
        mode=m,
        # FULL graphs capture the attention op too: naming it there only draws a warning.
        split_ops=[MIXED_ATTENTION_OP] if m.has_piecewise else [],
        max_tokens=max_tokens,
        query_len=query_len,
        fill_values=model.pad_fill_values(),
        names=INPUT_NAMES,
        full_sizes=full_sizes,
        piecewise_sizes=piecewise_sizes,
        full_mixed=full_mixed,
        backend_factory=make_backend,
        progress=progress,
        name=name,
        # Capture's forwards write the KV cache only at the scratch slot (the padded
        # rows' fill values), never a live request's row: declared, nothing to snapshot.
        state=[],
    )


def release(dispatcher: Dispatcher) -> None:
    """Drop the graphs of both runners (if any)."""
    for runner in (dispatcher.full, dispatcher.piecewise):
        rel = getattr(runner, "release", None)
        if rel is not None:
            rel()


def default_max_tokens(max_batch: int, spec_tokens: int, chunk: int) -> int:
    """Token budget of a step: every request verifying ``1 + k`` tokens, plus one chunk."""
    return max_batch * (1 + spec_tokens) + chunk


# --------------------------------------------------------------------------- scheduler


@dataclass
class Request:
    """A sequence: its prompt, what it has emitted, and how much of it is cached."""

    rid: int
    slot: int
    prompt: list[int]
    max_new: int
    pos: int = 0
    """Tokens already in the KV cache (positions ``0..pos-1``)."""
    out: list[int] = field(default_factory=list)
    """Tokens emitted so far; the last one is the next input (not cached yet)."""

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class SpecStats:
    """Speculative-decode counters."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        """Fraction of drafted tokens that were accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request emits per verify step: 1 (the model's own) + accepted drafts."""
        return (self.verify_steps + self.accepted) / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verify_rows": self.verify_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "tokens_per_step": self.tokens_per_step,
            "emitted": self.emitted,
        }


class EngineScheduler:
    """Requests in KV slots, prefilled in chunks, then decoded or verified each step.

    Args:
        max_batch, max_context: the model's cache limits (slots, positions per slot).
        max_tokens: token budget of a step. Decoding requests are always scheduled
            (so it must be at least ``max_batch * (1 + spec_tokens)``); prefill chunks
            fill what remains.
        spec_tokens: ``k`` drafts verified per decoding request per step (0: plain decode).
        prompt_len: prompts are drawn uniformly from ``1..2*prompt_len`` tokens (capped
            so every request has room to decode).
        chunk: the most prompt tokens one request prefills per step.
        max_new: a request finishes after emitting ``max_new/2..max_new`` tokens (drawn
            per request), or when its context is full.
        vocab: token ids are drawn from ``0..vocab-1``.
        seed: the host RNG for prompts, lengths and fallback drafts.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        max_context: int,
        max_tokens: int,
        vocab: int,
        spec_tokens: int = 0,
        prompt_len: int = 16,
        chunk: int = 32,
        max_new: int = 64,
        seed: int = 0,
    ) -> None:
        for arg, value, low in (
            ("max_batch", max_batch, 1),
            ("max_context", max_context, 1),
            ("max_tokens", max_tokens, 1),
            ("vocab", vocab, 1),
            ("spec_tokens", spec_tokens, 0),
            ("prompt_len", prompt_len, 1),
            ("chunk", chunk, 1),
            ("max_new", max_new, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(
                    f"EngineScheduler: {arg} must be an int >= {low}, got {value!r}"
                    + (" (no request could ever be admitted)" if arg == "max_batch" else "")
                )
        q = 1 + spec_tokens
        if max_tokens < max_batch * q:
            raise ConfigError(
                f"EngineScheduler: max_tokens={max_tokens} < max_batch * (1 + spec_tokens) = "
                f"{max_batch * q}: a step of every request verifying would not fit; raise "
                f"max_tokens to at least {max_batch * q}"
            )
        if max_context < q + 2:
            raise ConfigError(
                f"EngineScheduler: max_context={max_context} is too small for q={q} tokens per "
                f"step (1 + spec_tokens); it must be >= {q + 2}"
            )
        self.max_batch = max_batch
        self.max_context = max_context
        self.max_tokens = max_tokens
        self.vocab = vocab
        self.spec_tokens = spec_tokens
        self.prompt_len = prompt_len
        self.chunk = chunk
        self.max_new = max_new
        self.rng = random.Random(seed)
        self.free = list(range(max_batch))
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.stats = SpecStats()
        self._next_rid = 0

    # -------------------------------------------------------------- membership

    def _admit(self) -> None:
        q = 1 + self.spec_tokens
        longest = max(1, self.max_context - q - 1)
        n = min(longest, self.rng.randint(1, 2 * self.prompt_len))
        prompt = [self.rng.randrange(self.vocab) for _ in range(n)]
        req = Request(
            self._next_rid,
            self.free.pop(0),
            prompt,
            max_new=self.rng.randint(max(1, self.max_new // 2), self.max_new),
        )
        self._next_rid += 1
        self.live.append(req)

    def _finish(self, req: Request) -> None:
        self.live.remove(req)
        self.free.append(req.slot)
        self.finished.append(req)

    def set_live(self, target: int) -> None:
        """Finish the oldest requests above ``target``; admit new ones up to it."""
        target = max(1, min(target, self.max_batch))
        while len(self.live) > target:
            self._finish(self.live[0])
        while len(self.live) < target and self.free:
            self._admit()

    # ------------------------------------------------------------------- steps

    def _drafts(self, req: Request, k: int) -> tuple[int, ...]:
        """n-gram prompt lookup over the request's history (prompt and emitted tokens).

        The ``k`` tokens that followed the latest earlier occurrence of the history's
        last ``n`` tokens, trying ``n = 3, 2, 1`` and only occurrences with ``k`` tokens
        after them, searched over the last :data:`LOOKUP_WINDOW` tokens. Where none
        exists, the last token repeated: greedy decoding of small or random-weight
        models falls into loops, which both rules then predict.
        """
        hist = req.history
        size = len(hist)
        lo = max(0, size - LOOKUP_WINDOW)
        for n in (3, 2, 1):
            if size <= n:
                continue
            tail = hist[size - n :]
            last = tail[-1]
            for j in range(size - n - k, lo - 1, -1):
                if hist[j + n - 1] == last and hist[j : j + n] == tail:
                    return tuple(hist[j + n : j + n + k])
        return (hist[-1],) * k

    def next_batch(
        self, device: torch.device, *, spec: bool = True, prefill: bool = True
    ) -> StepBatch | None:
        """The next step's batch, or None when nothing can run.

        ``spec=False`` makes decoding requests take one token this step even with
        ``spec_tokens > 0`` (a plain decode batch); ``prefill=False`` holds prefilling
        requests back (so the step is uniform when anything decodes).
        """
        k = self.spec_tokens if spec else 0
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[Rows] = []
        budget = self.max_tokens
        for req in self.live:
            if req.prefilling:
                continue
            drafts = self._drafts(req, k) if k else ()
            n = 1 + k
            rows.append(Rows(req.rid, len(tokens), n, "verify" if k else "decode", drafts))
            tokens += [req.out[-1], *drafts]
            positions += range(req.pos, req.pos + n)
            slots += [req.slot] * n
            budget -= n
        if prefill or not rows:
            for req in self.live:
                if not req.prefilling or budget <= 0:
                    continue
                n = min(self.chunk, len(req.prompt) - req.pos, budget)
                rows.append(Rows(req.rid, len(tokens), n, "prefill"))
                tokens += req.prompt[req.pos : req.pos + n]
                positions += range(req.pos, req.pos + n)
                slots += [req.slot] * n
                budget -= n
        if not rows:
            return None
        return make_batch(tokens, positions, slots, rows, device)

    def commit(self, batch: StepBatch, greedy: Sequence[int]) -> None:
        """Advance every request of ``batch`` given the greedy token of each row."""
        if len(greedy) != batch.num_tokens:
            raise ConfigError(
                f"EngineScheduler.commit: {len(greedy)} greedy tokens for a batch of "
                f"{batch.num_tokens}; pass one per row of the step's logits"
            )
        by_id = {r.rid: r for r in self.live}
        q = 1 + self.spec_tokens
        for row in batch.rows:
            req = by_id[row.rid]
            g = greedy[row.start : row.start + row.length]
            if row.kind == "prefill":
                req.pos += row.length
                if not req.prefilling:
                    req.out.append(g[-1])
                    self.stats.emitted += 1
            else:
                accepted = 0
                while accepted < len(row.drafts) and row.drafts[accepted] == g[accepted]:
                    accepted += 1
                emitted = [*row.drafts[:accepted], g[accepted]]
                req.pos += 1 + accepted
                req.out += emitted
                self.stats.emitted += len(emitted)
                if row.kind == "verify":
                    self.stats.verify_steps += 1
                    self.stats.drafted += len(row.drafts)
                    self.stats.accepted += accepted
            if len(req.out) >= req.max_new or req.pos + q + 1 > self.max_context:
                self._finish(req)


__all__ = [
    "INPUT_NAMES",
    "EngineScheduler",
    "Request",
    "Rows",
    "SpecStats",
    "StepBatch",
    "build_dispatcher",
    "default_max_tokens",
    "make_batch",
    "release",
]
