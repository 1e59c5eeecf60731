"""``GraphRunner``: one callable, a ladder of batch sizes, one CUDA graph per size.

The replay path (``runner(*inputs)``, on :class:`~graphguard.ladder.replay.ReplayPath`) is:
one list index to find the entry for the batch size, one C-level comparison of every
input's (shape, dtype, device) against what was captured, one fused copy of all inputs
into the static buffers, a refill of padded rows only when the batch shrank, then the FULL
kind's run (:class:`~graphguard.ladder.full.FullGraphs`): ``graph.replay()`` and cached output
views. Nothing on it allocates, synchronizes or logs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from graphguard import capture as lifecycle
from graphguard.arguments import check_flag, check_keywords, sanitize_enabled
from graphguard.backend import Captured, Graph, GraphBackend, free_graph
from graphguard.compiled import CompiledStep
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.estimate import estimate_pool_bytes
from graphguard.keywords import CaptureKwargs, option_keywords, runner_keywords
from graphguard.ladder import GraphLadder
from graphguard.ladder.full import FullGraphs, WholeGraphs
from graphguard.mode import Mode
from graphguard.options import CaptureOptions
from graphguard.serving import Agreement
from graphguard.sizes import is_int, validate_sample_sizes

logger = logging.getLogger("graphguard")

DRIVER_PROBES = 16
"""Throwaway graphs :meth:`GraphRunner.estimate_graph_memory` holds at once to measure the
driver's share of one graph."""


class GraphRunner(GraphLadder):
    """Capture ``fn`` as CUDA graphs for a ladder of batch sizes and replay them.

    Args:
        fn: the callable to capture, taking the inputs positionally and returning a
            tensor or a tuple / namedtuple / dict / dataclass of tensors (no Python
            numbers: a graph would freeze them at their capture value).
        example_inputs: a tuple of tensors, one per input; they give dtype, device and
            the shape apart from the batch dimension (their batch size does not matter,
            their values are not used).
        mode: ``"full"`` (one graph per size) or ``"none"`` (everything eager through
            the same API).
        compile: capture an Inductor-compiled step (:class:`graphguard.compiled.CompiledStep`,
            no Inductor CUDA graphs): one compile for the whole ladder, the batch dimension
            symbolic; without ``sizes`` the ladder is ``compiled_capture_sizes(max_size)``
            (batch 1 pads to 2, which keeps it to one compile). The report counts the
            compiles and their seconds; a recompile after capture raises. Eager fallback
            and :meth:`verify`'s reference run the uncompiled ``fn``; with the sanitizer on,
            the eager kernels are captured (see :mod:`graphguard.compiled`).
        share_outputs: each graph's output blocks go back to the pool after its capture
            (kept as views that do not own them), so the ladder's pool is about its largest
            graph's alone. Default True; False: every graph owns its outputs (more pool,
            outputs of different sizes never alias). ``runner.share_outputs``.
        sanitize: build the runner with the sanitizer's checks, a part it calls at each
            step (:mod:`graphguard.sanitizer`; the runner stays a ``GraphRunner``).
            Default ``None``: the
            ``GRAPHGUARD_SANITIZE`` environment variable
            (:data:`~graphguard.config.SANITIZE_ENV`). Off, the replay path is exactly the
            fast path and no sanitizer module is imported. ``runner.sanitize``.
        options: a :class:`~graphguard.CaptureOptions` to share between runners; the
            option keywords given beside it win over its fields.
        sizes, max_size, batch_dims, fill_values, names, warmup_iters, before_capture,
            after_capture, workspaces, state, copy_outputs, capture_error_mode,
            on_capture_error, progress, name, generators, weights, canary, lazy,
            provenance: the
            capture options, each documented once on :class:`~graphguard.CaptureOptions`
            (``None``: the default). ``runner.options`` holds the values in force.
        backend: the device backend (default :class:`CudaBackend` on the inputs' device).
        agreement: how tensor-parallel ranks agree on lazy captures and canary verdicts
            (:class:`~graphguard.serving.Agreement`; ``DistributedGraphRunner`` passes
            itself). None: one process.

    Contract: outputs are views into memory the next call overwrites, whichever size it
    replays (graphs share one pool and reuse each other's output blocks); clone what you
    keep, or pass ``options=CaptureOptions(copy_outputs=True)``. Outputs the caller still
    holds after :meth:`release` point at freed memory (with ``share_outputs`` they do not own it):
    reading them is undefined, and the sanitizer poisons them on release. Replay is
    ordered on the current stream like any kernel launch and adds no synchronization.
    Inputs that require grad are replayed on detached copies (warned once): outputs never
    carry autograd history. A runner is not thread-safe: call it from one thread.
    """

    _kind = "GraphRunner"
    _mode_hint = (
        "GraphRunner runs whole-callable graphs (mode 'full' or 'none'); for mode 'piecewise' "
        "use graphguard.PiecewiseRunner (graphguard.piecewise), and for 'full_and_piecewise' "
        "graphguard.build_dispatcher"
    )

    @option_keywords
    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        *,
        mode: Mode | str = Mode.FULL,
        compile: bool = False,
        share_outputs: bool = True,
        sanitize: bool | None = None,
        options: CaptureOptions | None = None,
        backend: GraphBackend | None = None,
        agreement: Agreement | None = None,
        **kwargs: Unpack[CaptureKwargs],
    ) -> None:
        check_keywords(type(self).__name__, kwargs, runner_keywords(GraphRunner.__init__))
        self.sanitize = sanitize_enabled(sanitize)
        opts = CaptureOptions.merge(options, where=self._kind, **kwargs)
        check_flag("compile", compile)
        check_flag("share_outputs", share_outputs)
        self.share_outputs: bool = share_outputs
        """Whether each graph's outputs go back to the pool after its capture."""
        self._full = FullGraphs(
            fn,
            share_outputs=share_outputs,
            compile=compile and Mode.parse(mode) is Mode.FULL,
            sizes_given=opts.sizes is not None,
        )
        super().__init__(fn, example_inputs, opts, mode, backend, agreement, kind=self._full)

    @property
    def compiled_step(self) -> CompiledStep | None:
        """With ``compile=True``: the Inductor-compiled step warmups and captures run
        (``compiles``, ``compile_s``, ``recompile_reasons``); ``fn`` stays the eager one."""
        return self._full.compiled_step

    @property
    def graph_outputs(self) -> dict[int, list[Any]]:
        """Each captured size's output leaves (views into the pool), for the sanitizer's
        names and debugging."""
        return self._full.graphs.graph_leaves

    def graph(self, size: int) -> Graph:
        """The captured graph of ``size`` (for benchmarks and debugging; replaying it
        directly skips the input copy and padding)."""
        if not is_int(size):  # True would find the size-1 graph
            raise ConfigError(
                f"{self.name}: graph(size) takes a captured size (an int), got "
                f"{type(size).__name__} {size!r:.60}"
            )
        try:
            return self._full.graphs.graphs[size]
        except KeyError:
            raise GraphGuardError(
                f"{self.name}: no graph of size {size}; captured {list(self.captured_sizes)}"
            ) from None

    def estimate_graph_memory(self, sample_sizes: Sequence[int] | None = None) -> int:
        """Estimate the graph memory of the whole ladder without keeping any graph: the
        pool plus the driver's share outside the allocator (:mod:`graphguard.ledger`).

        For an engine that sizes its KV cache from free memory *before* capturing: the
        ``before_capture`` hooks run (so arenas reach their size), then the largest size
        and a few smaller ones are captured into a throwaway pool as a profiling capture
        (arenas stay unlocked, the process stays out of SERVING), released, and the
        cached blocks handed back to the driver. The estimate is the growth the sampled
        sizes caused, summed (:func:`graphguard.estimate.estimate_pool_bytes` says why),
        plus, without ``share_outputs``, the output rows every unsampled size keeps, plus
        the sampled graphs' mean driver share times the number of sizes.

        Accuracy measured on the H200: within 2 % of the kept ladder on the reference 1B
        step; on a small MoE ladder the kept pool was up to 7 % larger (a 2 MiB segment or
        two of fragmentation), so leave that margin when sizing a KV cache from it.
        """
        sample_sizes = validate_sample_sizes(sample_sizes, self.sizes)
        if self.mode is Mode.NONE:
            return 0
        desc = sorted(self.sizes, reverse=True)
        if sample_sizes is None:
            rest = desc[1:]
            picks = {rest[0], rest[len(rest) // 2], rest[-1]} if rest else set()
            sample = [desc[0], *sorted(picks, reverse=True)]  # largest, second, middle, smallest
        else:
            sample = sorted(set(sample_sizes) | {desc[0]}, reverse=True)
        throwaway = WholeGraphs(self.name, self.share_outputs)
        capturer = self._capturer
        base = capturer.plan()
        plan = dataclasses.replace(
            base,
            sizes=sample,
            body=lambda size: throwaway.body(size, capturer.capture_forward(size)),
            register=lambda size, c: throwaway.register(size, c.graph, c.result),
            profiling=True,
            name=f"{self.label} estimate",
            after_capture=(),
            discard=lambda sizes: throwaway.clear(),
            on_capture_error="raise",
            progress=False,
        )
        report = lifecycle.run(plan, self.backend)
        driver_each = self._driver_per_graph(plan, desc[-1], capturer.capture_forward)
        per_row = 0
        dims = capturer.parts.store.layout.dims
        if not throwaway.share_outputs and throwaway.out_leaves is not None and dims:
            # Owned outputs: every unsampled size also keeps its own output rows.
            per_row = sum(
                x.nbytes // max(1, x.shape[d])
                for x, d in zip(throwaway.out_leaves, dims)
                if d is not None
            )
        throwaway.clear()
        self.backend.synchronize()
        self.backend.empty_cache()
        pool = estimate_pool_bytes(
            [(s.size, s.pool_growth_bytes) for s in report.sizes],
            desc,
            retained_bytes_per_row=per_row,
        )
        driver = round(driver_each * len(desc))
        largest = report.sizes[0].pool_growth_bytes
        logger.info(
            "%s: estimated graph memory %.3f GiB for %d sizes: pool %.3f GiB (largest "
            "%.3f GiB, sampled %s) + %.1f MiB outside the allocator",
            self.name,
            (pool + driver) / 2**30,
            len(desc),
            pool / 2**30,
            largest / 2**30,
            sample,
            driver / 2**20,
        )
        return pool + driver

    def _driver_per_graph(
        self,
        plan: lifecycle.CapturePlan,
        size: int,
        forward: Callable[[int], Callable[[], Any]],
    ) -> float:
        """The driver's share of one graph, from ``DRIVER_PROBES`` more throwaway captures
        of ``size`` held at once. Why: free device memory moves in 2 MiB pages, and one
        graph of a 1B decode step takes about half a MiB, so a few sampled graphs read 0 or
        2 MiB each; the share is per graph (its nodes, the same at every size), so many
        graphs of the cheapest size measure it to a fraction of a page."""
        backend = self.backend
        kept: list[Captured] = []
        probe = dataclasses.replace(
            plan,
            name=f"{self.label} driver probe",
            sizes=[size] * DRIVER_PROBES,  # warmups kept: a step may need them (HF's cache)
            before_capture=(),
            body=forward,
            register=lambda s, captured: kept.append(captured),
            discard=lambda sizes: kept.clear(),
            watch=None,
        )
        free0, reserved0 = backend.free_bytes(), backend.reserved_bytes()
        lifecycle.run(probe, backend)
        free1, reserved1 = backend.free_bytes(), backend.reserved_bytes()
        for captured in kept:
            free_graph(captured.graph)
        kept.clear()
        return max(0, (free0 - free1) - (reserved1 - reserved0)) / DRIVER_PROBES


__all__ = ["GraphRunner"]
