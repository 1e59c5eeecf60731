"""Inductor-compiled steps under graphguard: one compile for the whole capture ladder.

Contract: :class:`CompiledStep` wraps a step in ``torch.compile`` with Inductor *without*
Inductor's own CUDA graphs (graphguard captures them) and with the batch dimension of
every input symbolic, so the first call (the largest size's uncaptured warmup in the
capture lifecycle) compiles once and every smaller size's warmup and capture replays
the same kernels. ``backed_size_oblivious`` keeps dynamo from specializing sizes 0 and
1, but a step that broadcasts two batch-sized inputs against each other (``index_put_``
with batch-sized index tensors, as every KV-cache write does) still gets a ``size >= 2``
guard from Inductor, so a size-1 capture compiles a second graph (on torch 2.11 one of
those failed to compile at all). :func:`compiled_capture_sizes` is the default ladder
without 1: batch 1 pads to 2, which costs a decode step ~5% on the H200 and keeps one
compile.

Auxiliary streams: dynamo cannot trace ``record_stream``, and a fork decided by the
capture phase recompiles between warmup and capture, so ``AuxStream.fork`` runs its
branch inline while ``torch.compiler.is_compiling()`` (compiled steps lose the overlap).

``GraphRunner(..., compile=True)`` wraps the step in a :class:`CompiledStep` and, without
``sizes``, captures :func:`compiled_capture_sizes`.

While serving (after a capture), a recompile is a bug: the graphs were captured from one
compile, and a second one means a guard no longer holds. Dynamo then runs with
``error_on_recompile`` and the failure is raised as :class:`GraphGuardError` naming the
guard that failed. A recompile during warmup or capture is allowed, counted
(:attr:`CompiledStep.compiles`) and logged with dynamo's reason.

What the sanitizer loses: under a ``TorchDispatchMode`` (the sanitizer's capture
recorder and warmup monitor) dynamo does not run compiled code, so a sanitized runner
warms up and captures the step's *eager* kernels. Its checks (storages, streams, unsafe
ops) still see every op; only the Inductor fusion is absent from the sanitized graphs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphguard import phase
from graphguard._torch_compat import GuardFailures, code_site, size_oblivious
from graphguard.errors import ConfigError, GraphGuardError
from graphguard.phase import Phase
from graphguard.report import CaptureReport

logger = logging.getLogger("graphguard")

_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def _inductor_options(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    if mode in _CUDAGRAPH_MODES:
        raise ConfigError(
            f"CompiledStep(mode={mode!r}): that mode records Inductor's own CUDA graphs, which "
            "cannot be captured inside graphguard's. Use mode=None (default) or "
            "'max-autotune-no-cudagraphs'."
        )
    from torch._inductor import list_mode_options

    opts: dict[str, Any] = dict(list_mode_options(mode or "default"))
    opts.update(options or {})
    if opts.get("triton.cudagraphs"):
        raise ConfigError(
            "CompiledStep: options={'triton.cudagraphs': True} records Inductor's own CUDA "
            "graphs inside graphguard's capture; leave it False"
        )
    opts["triton.cudagraphs"] = False
    return opts


class CompiledStep:
    """A step compiled by Inductor once for every batch size; see the module docstring.

    ``GraphRunner(CompiledStep(model.step), example_inputs, sizes=...)`` compiles during
    the largest size's warmup; ``compiles`` stays 1 for the whole ladder when the step
    has no graph break (``GraphRunner(..., compile=True)`` builds one for you).

    Args:
        fn: the step (a function or bound method taking tensors positionally).
        batch_dims: the batch dimension of each positional tensor input (one int for all).
        mode: an Inductor mode without CUDA graphs: ``None`` / ``"default"`` or
            ``"max-autotune-no-cudagraphs"``.
        options: extra Inductor config patches.
        fullgraph: forbid graph breaks (``torch.compile(fullgraph=True)``).
        name: shown in logs and errors.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        batch_dims: int | Sequence[int] = 0,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        fullgraph: bool = False,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"CompiledStep: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.batch_dims = batch_dims
        self.mode = mode
        self._options = _inductor_options(mode, options)
        self.compiles = 0
        """Graphs Inductor compiled (one per dynamo frame; more than one = a recompile
        or a graph break)."""
        self.recompile_reasons: list[str] = []
        self.compile_s = 0.0
        """Wall seconds of the calls that compiled (dynamo tracing and Inductor)."""
        self._guard_failures = GuardFailures()
        self._compiled = torch.compile(fn, backend=self._backend, fullgraph=fullgraph)
        self.__qualname__ = self.name  # what GraphRunner names the runner after

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        if self.compiles > 1:
            reasons = [f"{code_site(code)}: {r}" for code, r in self._guard_failures.new()]
            self.recompile_reasons += reasons
            logger.warning(
                "%s: torch.compile compiled graph #%d (phase %s): %s",
                self.name,
                self.compiles,
                phase.current_phase().value,
                "; ".join(reasons) or "a graph break or a new frame (no guard failed)",
            )
        return compile_fx(gm, example_inputs, config_patches=self._options)

    def _dims(self, n: int) -> Sequence[int]:
        if isinstance(self.batch_dims, int):
            return [self.batch_dims] * n
        return self.batch_dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the compiled step (compiling on the first call); batch dims marked dynamic."""
        for t, dim in zip(args, self._dims(len(args))):
            if isinstance(t, torch.Tensor) and t.ndim > dim:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        serving = phase.current_phase() in (Phase.SERVING,) and self.compiles > 0
        before, t0 = self.compiles, time.perf_counter()
        with size_oblivious(), _error_on_recompile(serving):
            try:
                return self._compiled(*args, **kwargs)
            except Exception as exc:
                if serving and type(exc).__name__ == "RecompileError":
                    raise GraphGuardError(
                        f"{self.name}: torch.compile would recompile while serving (inputs "
                        f"{_shapes(args)}): {str(exc).strip()}. The captured graphs came from "
                        f"{self.compiles} compile(s) and must serve every batch. To fix: keep "
                        "Python state the step reads (flags, shapes other than the batch "
                        "dimension, module attributes) fixed after capture, or call "
                        "runner.recapture(reason=...) after changing it on purpose."
                    ) from exc
                raise
            finally:
                if self.compiles != before:
                    self.compile_s += time.perf_counter() - t0

    def fill_report(self, report: CaptureReport) -> CaptureReport:
        """``report`` with this step's compiles, their seconds and recompile reasons."""
        report.set_compiles(self.compiles, self.recompile_reasons, self.compile_s)
        return report

    def __repr__(self) -> str:
        return f"CompiledStep({self.name}, mode={self.mode or 'default'}, compiles={self.compiles})"


def _shapes(args: Sequence[Any]) -> str:
    return ", ".join(
        str(tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args
    )


@contextlib.contextmanager
def _error_on_recompile(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def compiled_capture_sizes(max_size: int) -> list[int]:
    """The default ladder up to ``max_size`` without size 1 (batch 1 pads to 2), so a
    compiled step needs one compile (see the module docstring)."""
    from graphguard.sizes import capture_sizes

    sizes = [s for s in capture_sizes(max_size) if s > 1]
    return sizes or [max_size]


__all__ = ["CompiledStep", "compiled_capture_sizes"]
