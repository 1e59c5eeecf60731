"""The forward steps of one HF continuous-batching engine, through one graphguard runner.

One :class:`StepGraphs` per HF ``ContinuousBatchProcessor`` (its paged cache and static IO
buffers): the graphs are bound to their addresses, and a processor keeps them for its
whole life (a persistent manager keeps its processor across ``generate_batch`` calls).

How a key becomes a graph. The keys (:mod:`._hf_cb_keys`) are not known up front, and
graphguard's lifecycle (lazy capture under a budget, one pool, the ledger, the canary,
``update_weights``) is the :class:`~graphguard.GraphRunner`'s, whose graphs are indexed by
an int size. So each new key takes the next free **slot** ``k`` of a ladder ``1..max_graphs``
and the runner is called with a ``[k]`` tensor: the step callable reads ``k`` off that
shape and runs HF's own ``_forward_process_and_sample`` on the ``batch_data`` recorded for
the key (views of HF's static buffers, the same storages each time the key recurs). A
batch never pads (it is called at its slot's size exactly), every slot's graph lands in
the runner's one pool (as HF's graphs share one pool), and a slot the budget refuses, or
whose capture fails, runs HF's step eagerly. Past ``max_graphs`` keys, steps run eagerly
(counted in :meth:`StepGraphs.stats`).

A slot is never served by another slot's graph. The runner pads a batch whose size it
refused up to the next larger size, which for step slots means replaying another key's
step (or, past every key, a graph of nothing: all-zero tokens); so a refused slot runs
HF's step eagerly here, and a capture of a slot with no key is refused.

A step that raises leaves nothing behind: when the step that introduced a new key raises
(a token id past the vocabulary, any exception, while the key was being captured or
served), the key is forgotten and its slot retired for good (never assigned again; a
graph it got is dropped), so a later step with that key takes a fresh slot and a fresh
capture. A key that already had a graph keeps it: that graph was captured from a step
that ran.

What the step writes: HF's ``output_ids`` (the declared state, restored around every
capture and compared by the canary) and the paged KV cache at the slots HF allotted to
this batch (``write_index`` / block table; padded tokens go to HF's trash slot). Those
KV writes are not declared: a step recomputed from the same inputs writes the same values
to the same slots, so a warmup, a capture or a canary's shadow run leaves the cache as the
step itself does; declaring the whole paged cache would clone it (GiBs) at every capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from graphguard import GraphRunner, Lazy, phase
from graphguard.config import CaptureOptions
from graphguard.integrations._hf_cb_keys import StepKey, signature, step_key
from graphguard.state import StateSet

logger = logging.getLogger("graphguard")


class StepGraphs:
    """HF's model runner's ``compute_batch``, with each forward step through graphguard."""

    def __init__(
        self,
        model_runner: Any,
        model: Any,
        *,
        max_graphs: int,
        options: CaptureOptions,
        mode: str,
        backend: Any,
        sanitize: bool | None,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.model_runner = model_runner
        self.model = model
        self.io = model_runner.inputs_and_outputs
        self.max_graphs = max_graphs
        self._on_error = on_error
        self.carry, self.prev, self.output_ids = self.io.get_cb_kwargs()
        self._out_buffers = [self.carry, self.prev, self.output_ids]
        self.device = self.output_ids.device
        self.slots: dict[tuple[Any, ...], int] = {}
        """Each live key's signature -> its slot (slots of forgotten keys are not reused)."""
        self._next_slot = 1
        self.keys: list[StepKey | None] = [None] * (max_graphs + 1)
        self._data: list[tuple[Callable[..., Any], dict[str, Any]] | None] = [None] * (
            max_graphs + 1
        )
        self.eager_table_full = 0
        """Steps run eagerly because every slot already had a key."""
        self.eager_refused = 0
        """Steps of a key whose slot the runner refused (over budget, capture failed),
        run eagerly here rather than padded up to another key's slot."""
        self._eager_counts: dict[int, int] = {}  # per slot, the eager_refused steps
        self.failed_keys = 0
        """New keys forgotten because the step that introduced them raised."""
        self.steps = 0
        self.processor_ref: Callable[[], Any] | None = None
        """HF's ``ContinuousBatchProcessor`` (a weak reference), set when installed."""
        self.manager_ref: Callable[[], Any] | None = None
        """The ``ContinuousBatchingManager`` that built it (a weak reference)."""
        # One tiny input per slot, made now: a step only looks its slot's up.
        self._slot_inputs = [
            torch.zeros(k, dtype=torch.uint8, device=self.device) for k in range(max_graphs + 1)
        ]
        lazy = options.lazy if options.lazy is not None else Lazy()
        self.runner = GraphRunner(
            self._step,
            (torch.zeros(1, dtype=torch.uint8, device=self.device),),
            mode=mode,
            sanitize=sanitize,
            backend=backend,
            options=dataclasses.replace(
                options,
                sizes=list(range(1, max_graphs + 1)),
                fill_values=(0,),
                names=("slot",),
                state=StateSet({"output_ids": self.output_ids}),
                weights=model,
                lazy=lazy,
                name=options.name or f"{type(model).__name__}.cb_step",
            ),
        )

    # ------------------------------------------------------------------ the step

    def _step(self, slot: torch.Tensor) -> torch.Tensor:
        """What the runner captures for slot ``k = slot.shape[0]``: HF's forward step on the
        key's recorded arguments. Returns a copy of ``output_ids`` (one shape for every
        key), which the canary compares with the eager step's."""
        k = int(slot.shape[0])
        data = self._data[k] if k < len(self._data) else None
        if data is not None:
            forward_fn, batch_data = data
            forward_fn(self.model, batch_data, self.carry, self.prev, self.output_ids)
        elif phase.is_capturing():  # a graph of nothing would replay all-zero tokens
            raise RuntimeError(
                f"{self.runner.name}: graph slot {k} has no step key, so its graph would run "
                "no step; refused (a batch padded up to an unused slot)"
            )
        # else: the runner's layout probe at a slot with no key yet (outputs only)
        out: torch.Tensor = self.output_ids.clone()
        return out

    def _signature(self, batch_data: dict[str, Any]) -> tuple[Any, ...]:
        """The step's full key (:func:`._hf_cb_keys.signature`): every argument, the output
        buffers and the runner's Python flags."""
        mr = self.model_runner
        processing = getattr(mr.logit_processor, "do_processing", None)
        flags = (bool(mr.do_sample), bool(mr.return_logprobs), processing, self.model.training)
        return signature(batch_data, self._out_buffers, flags)

    def _key(self, batch_data: dict[str, Any], sig: tuple[Any, ...] | None = None) -> StepKey:
        """The step's key with what a person reads (HF's own key, the baked values)."""
        get_key = getattr(self.io, "_get_graph_key", None)
        hf_key = tuple(get_key()) if callable(get_key) else ()
        if sig is None:
            sig = self._signature(batch_data)
        return step_key(batch_data, sig, hf_key)

    def compute_batch(self, model: Any, batch_data: dict[str, Any]) -> None:
        """Stands in for ``ModelRunner.compute_batch`` (same arguments, same effects)."""
        try:
            self._compute(model, batch_data)
        except BaseException as exc:
            self._on_error(exc)
            raise

    def _compute(self, model: Any, batch_data: dict[str, Any]) -> None:
        """One step. Per step only the key's signature is built and looked up; the
        readable :class:`StepKey` (HF's key, baked values) is built for a new key only. A
        slot whose graph exists replays through the runner's zero-copy path
        (``replay(slot)``): the slot input's values are never read (only its shape), so
        nothing is copied into the static buffer; the canary and the replay count are the
        same as ``runner(*inputs)``'s. A slot with no graph yet (lazy capture), refused or
        eager goes through ``runner(slot_input)``."""
        mr = self.model_runner
        if model is not self.model:
            from graphguard.errors import ConfigError

            raise ConfigError(
                f"continuous batching step called with {type(model).__name__} "
                f"{id(model):#x}, but its graphs were set up for {type(self.model).__name__} "
                f"{id(self.model):#x}; one manager serves one model"
            )
        if mr.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        forward_fn, _ = mr._get_forward_fn(use_block_table=self.io.use_block_table)
        sig = self._signature(batch_data)
        self.steps += 1
        slot = self.slots.get(sig)
        new = slot is None
        if slot is None:
            slot = self._assign(self._key(batch_data, sig), forward_fn, batch_data)
        stream = self.io.compute_stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        try:
            with ctx:
                if slot is None:
                    forward_fn(model, batch_data, self.carry, self.prev, self.output_ids)
                elif self.runner.padded_size(slot) != slot:
                    # Refused (over budget, capture failed): the runner pads it up to the
                    # next size, another key's graph (its entry points there). Eagerly.
                    self.eager_refused += 1
                    self._eager_counts[slot] = self._eager_counts.get(slot, 0) + 1
                    forward_fn(model, batch_data, self.carry, self.prev, self.output_ids)
                elif self.runner.door.entries[slot] is not None:
                    self.runner.replay(slot)
                else:
                    self.runner(self._slot_inputs[slot])
        except BaseException:
            if new and slot is not None:
                self._forget(slot)
            raise

    def _assign(
        self, key: StepKey, forward_fn: Callable[..., Any], batch_data: dict[str, Any]
    ) -> int | None:
        """The next free slot for a new key, or None (every slot taken: eager)."""
        slot = self._next_slot
        if slot > self.max_graphs:
            if not self.eager_table_full:
                logger.warning(
                    "%s: more than max_graphs=%d step keys; key %s and later new keys run "
                    "eagerly (raise max_graphs, or coarsen HF's q/kv padding intervals)",
                    self.runner.name,
                    self.max_graphs,
                    key,
                )
            self.eager_table_full += 1
            return None
        self._next_slot += 1
        self.slots[key.sig] = slot
        self.keys[slot] = key
        self._data[slot] = (forward_fn, batch_data)
        logger.info("%s: new step key %s -> graph slot %d", self.runner.name, key, slot)
        return slot

    def _forget(self, slot: int) -> None:
        """The step that introduced the key of ``slot`` raised: forget the key (its next
        step takes a fresh slot and capture), retire the slot (never assigned again, so
        nothing can replay it) and drop a graph it got."""
        key = self.keys[slot]
        if key is not None:
            self.slots.pop(key.sig, None)
        self.keys[slot] = None
        self._data[slot] = None
        self.failed_keys += 1
        if slot in self.runner.captured_sizes:  # its own graph (an entry may point up)
            self.runner.door.drop_size(slot)
        logger.warning(
            "%s: the step that introduced key %s (graph slot %d) raised; the key is "
            "forgotten and slot %d retired (a later step with that key captures afresh)",
            self.runner.name,
            key,
            slot,
            slot,
        )

    # ------------------------------------------------------------------ serving

    def capture(self) -> None:
        """The runner's lazy stage (nothing captured until a key is first used), under
        ``no_grad`` as HF runs every step: the runner captures each key lazily in the grad
        mode of this stage, and HF may build the processor in its generation thread, where
        grad is on (its in-place KV writes then fail on a leaf that requires grad)."""
        with torch.no_grad():
            self.runner.capture()

    def release(self) -> None:
        """Drop every graph (HF's engine itself stays usable, eagerly, until re-installed)."""
        self.runner.release()

    def stats(self) -> dict[str, Any]:
        """Per key: its slot, HF's key for it, what it bakes, how it was served."""
        s = self.runner.stats()
        per = {row.size: row for row in s.sizes}
        rows = []
        for slot in sorted(self.slots.values()):
            key = self.keys[slot]
            row = per.get(slot)
            rows.append(
                {
                    "slot": slot,
                    "key": str(key),
                    "hf_key": key.hf_key if key else (),
                    "replays": row.replays if row else 0,
                    "eager": s.eager_batches.get(slot, 0) + self._eager_counts.get(slot, 0),
                    "status": row.status if row else None,
                }
            )
        return {
            "steps": self.steps,
            "keys": len(self.slots),
            "eager_table_full": self.eager_table_full,
            "eager_refused": self.eager_refused,
            "failed_keys": self.failed_keys,
            "captured": len(self.runner.captured_sizes),
            "graph_bytes": s.pool_bytes + s.driver_bytes,
            "per_key": rows,
            "runner": s,
        }


__all__ = ["StepGraphs"]
