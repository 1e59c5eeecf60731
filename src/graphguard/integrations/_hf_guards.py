"""Runtime guards of the transformers integration: what capture, ``generate`` and
``verify()`` check as they run, after :mod:`._hf_support` accepted the model.

A graph reads the addresses and the module flags it was captured with. These guards
refuse, by name and with the fix, what would otherwise replay silently wrong or fail
with a raw torch error: a model put back in training mode (:func:`raise_if_training`),
a forward that copies a host tensor to the GPU (:func:`refuse_host_copies`). Weights
moved since capture are the runner's own ``check_weights`` (one check for every
runner). :func:`with_compiles` copies the compile counters into a capture report and
warns when dynamo compiled nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from graphguard import CaptureReport
from graphguard.errors import (
    GraphCaptureError,
    UnsupportedModelError,
)
from graphguard.integrations._hf_support import FALLBACK

logger = logging.getLogger("graphguard")


def raise_if_training(model: Any, where: str) -> None:
    """Refuse a model with any module in training mode (``model.train()`` after build).

    Refused, not run eagerly: graphs were captured in eval mode, so a replay would
    silently skip dropout, and a training flag left on around ``generate`` is almost
    always a forgotten ``model.eval()``. Walks the modules (a few hundred attribute
    reads, once per call, never per token).
    """
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if not training:
        return
    more = f" and {len(training) - 3} more" if len(training) > 3 else ""
    shown = ", ".join(training[:3]) + more
    raise UnsupportedModelError(
        f"{where}: {type(model).__name__} has modules in training mode ({shown}), e.g. "
        "model.train() after GraphedCausalLM was built; the graphs hold the eval-mode "
        "forward (no dropout), so they would not compute what this model now computes. "
        "Call model.eval() first (or generate with model.generate for training-mode "
        "sampling)",
        reasons=(f"modules in training mode: {shown}",),
    )


def with_compiles(report: CaptureReport, step: Any, runner: Any, who: str) -> CaptureReport:
    """``report`` with the compile fields of ``step`` (None: unchanged); warns when dynamo
    compiled nothing, so the graphs hold eager kernels."""
    if step is None:
        return report
    step.fill_report(report)
    if not step.compiles and runner.captured_sizes and not runner.sanitize:
        logger.warning(  # dynamo ran the step eagerly instead (its warning says why)
            "%s: compile=True, but dynamo compiled nothing: the graphs hold eager kernels. "
            "Each GraphedCausalLM(compile='model') compiles the same function, so likely "
            "torch._dynamo.config.recompile_limit (%s) was reached: raise it (or "
            "torch._dynamo.reset()), then recapture()",
            who,
            torch._dynamo.config.recompile_limit,
        )
    return report


_HOST_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


def _model_line(exc: BaseException) -> str:
    """`` at file:line, in function: code`` of the deepest frame outside torch and
    graphguard (the model's own line)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno}, in {f.name}: {f.line}"


@contextlib.contextmanager
def refuse_host_copies(model: Any, runner: Any) -> Iterator[None]:
    """Turn a capture that failed on a host-to-device copy into a refusal.

    Some forwards copy a pageable host tensor to the GPU on every call (Falcon's
    multi-query ``_split_heads`` indexes with a Python list); eager runs it, a CUDA graph
    cannot capture it. That is a property of the model's code, not of one size, so the
    partial ladder is dropped and :class:`UnsupportedModelError` names the source line.
    """
    try:
        yield
    except GraphCaptureError as exc:
        cause = exc.cause or exc.__cause__
        if cause is None or _HOST_COPY not in str(cause):
            raise
        runner.release()
        where = _model_line(cause)
        reason = (
            f"its forward copies a host tensor to the GPU{where}, e.g. an index given as a "
            "Python list, which a CUDA graph cannot capture"
        )
        raise UnsupportedModelError(
            f"GraphedCausalLM cannot graph {type(model).__name__}: {reason}. Nothing is left "
            f"captured; compile=True may capture it (Inductor makes such constants device "
            f"tensors), else {FALLBACK}.",
            reasons=(reason,),
        ) from exc


__all__ = [
    "raise_if_training",
    "refuse_host_copies",
    "with_compiles",
]
