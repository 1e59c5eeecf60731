"""``GraphedCausalLM.verify()``: every captured size replayed and compared with eager.

A decode step writes the cache at the shared write position and advances it, so a replay
followed by an eager forward would compare two different steps. :class:`VerifyView`
presents the graphed LM to :func:`graphguard.verify` as a runner whose declared state is
the LM's ``cache_state`` (a :class:`~graphguard.state.StateSet`): the caller zeroes the
counters first, so every forward writes column 0 only (as capture's warmups do), verify
restores that state before the replay and before the eager forward, and the caller's
cache is given back as it was at the end. Default inputs are seeded random tokens and
positions (:meth:`VerifyView.inputs_maker`). The eager reference is the LM's
``eager_step``: the *uncompiled* model call (with ``compile=True`` the graphs hold
Inductor's kernels; pass ``rtol``/``atol`` for their rounding).

It reads the LM only through :class:`DecodeLM`, the LM's documented internal interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from graphguard import GraphRunner
from graphguard.buffers import InputSpec
from graphguard.state import StateSet


class DecodeLM(Protocol):
    """What :class:`VerifyView` needs of ``GraphedCausalLM``."""

    runner: GraphRunner
    cache_state: StateSet
    device: torch.device
    max_cache_len: int

    @property
    def vocab_size(self) -> int: ...

    def eager_step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_valid: torch.Tensor
    ) -> torch.Tensor: ...


class VerifyView:
    """A :class:`graphguard.verify.Verifiable` over a captured ``GraphedCausalLM``."""

    def __init__(self, lm: DecodeLM) -> None:
        self.lm = lm
        self.runner = lm.runner
        self.name: str = self.runner.name
        self.state: StateSet = lm.cache_state

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(self.runner.captured_sizes)

    @property
    def specs(self) -> Sequence[InputSpec]:
        return list(self.runner.specs)

    def __call__(self, *inputs: Any) -> Any:
        return self.runner(*inputs)

    def inputs_maker(self, seed: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Default inputs: seeded random token ids and positions, every cache column valid.

        Not :func:`graphguard.verify`'s default (each integer input's fill value): token
        0 at position 0 is often the padding token, whose embedding row is zero, and
        all-zero logits would agree whatever the graph read.
        """
        gen = torch.Generator(device=self.lm.device).manual_seed(seed)
        vocab = self.lm.vocab_size
        dev, length = self.lm.device, self.lm.max_cache_len

        def make(n: int) -> tuple[torch.Tensor, ...]:
            ids = torch.randint(0, vocab, (n, 1), generator=gen, device=dev)
            pos = torch.randint(0, length, (n, 1), generator=gen, device=dev)
            return ids, pos, torch.ones((n, length), dtype=torch.bool, device=dev)

        return make

    def eager(self, *inputs: torch.Tensor) -> torch.Tensor:
        input_ids, position_ids, kv_valid = inputs
        return self.lm.eager_step(input_ids, position_ids, kv_valid)


__all__ = ["DecodeLM", "VerifyView"]
