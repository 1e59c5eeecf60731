"""``build_dispatcher``: every mode for a step whose inputs are one row per token.

Any batch, uniform decode or a ragged mix of prefill chunks and decodes, is then ``n``
rows: the builder makes the plan, a GraphRunner and a PiecewiseRunner, and ties them in a
Dispatcher. Every argument mistake is a ConfigError raised before anything is captured.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import Unpack

from graphguard.backend import GraphBackend
from graphguard.config import CaptureKwargs, CaptureOptions, Mode, option_keywords
from graphguard.dispatch.dispatcher import Dispatcher
from graphguard.dispatch.keys import FLAG, failed
from graphguard.dispatch.plan import DispatchPlan
from graphguard.errors import ConfigError
from graphguard.piecewise import PiecewiseRunner
from graphguard.piecewise.split import SplitOp
from graphguard.runner import GraphRunner

logger = logging.getLogger("graphguard")

_SET_HERE = {
    "sizes": "use full_sizes= and piecewise_sizes= (the plan picks each runner's sizes)",
    "max_size": "use max_tokens= (the largest batch the engine schedules)",
    "batch_dims": "inputs are one row per token: dim 0 is the token dimension of every input",
}
"""Options the builder sets itself, and what to pass instead."""


def _maybe(f: object) -> bool:
    return f is None or callable(f)


def _as_split_ops(split_ops: Any) -> tuple[SplitOp, ...]:
    """One op or a sequence of ops; a bare string is one op (``"mylib::attention"``)."""
    if split_ops is None:
        return ()
    if isinstance(split_ops, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or (
        callable(split_ops) and not isinstance(split_ops, (list, tuple))
    ):
        return (split_ops,)
    if not isinstance(split_ops, (list, tuple)):
        raise ConfigError(
            f"split_ops must be a list of ops ('ns::name', torch.ops.ns.name or a "
            f"callable), got {type(split_ops).__name__}; e.g. split_ops=['mylib::attention']"
        )
    return tuple(split_ops)


def _check_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (list, tuple)) or not example_inputs:
        raise ConfigError(
            "example_inputs must be a non-empty tuple of tensors, one per input of the step "
            f"(one row per token), got {type(example_inputs).__name__}"
        )
    problems = []
    rows: int | None = None
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            problems.append(f"example_inputs[{i}] is a {type(x).__name__}, not a tensor")
        elif x.ndim == 0:
            problems.append(f"example_inputs[{i}] is a 0-d tensor (it needs a token dimension)")
        elif rows is None:
            rows = int(x.shape[0])
        elif int(x.shape[0]) != rows:
            problems.append(
                f"example_inputs[{i}] has {x.shape[0]} rows but example_inputs[0] has {rows}"
            )
    if problems:
        raise ConfigError(
            "build_dispatcher: " + "; ".join(problems) + ". Every input is one row per "
            "token along dim 0 (e.g. token_ids[n], positions[n], slots[n]); per-request "
            "metadata does not fit this builder (use GraphRunner / PiecewiseRunner and "
            "graphguard.Dispatcher directly)"
        )
    return tuple(example_inputs)


@option_keywords
def build_dispatcher(
    step: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    *,
    mode: Mode | str,
    split_ops: Sequence[SplitOp] | SplitOp = (),
    max_tokens: int,
    query_len: int = 1,
    full_sizes: Sequence[int] | None = None,
    piecewise_sizes: Sequence[int] | None = None,
    full_mixed: bool = False,
    eager: Callable[..., Any] | None = None,
    backend_factory: Callable[[], GraphBackend] | None = None,
    fullgraph: bool = True,
    options: CaptureOptions | None = None,
    **kwargs: Unpack[CaptureKwargs],
) -> Dispatcher:
    """A :class:`~graphguard.Dispatcher` running ``step`` in ``mode`` (nothing captured yet).

    Args:
        step: the callable; inputs positional, one row per token along dim 0.
        example_inputs: one tensor per input (dtype, device, trailing shape).
        mode: ``"none"``, ``"full"``, ``"piecewise"`` or ``"full_and_piecewise"``.
        split_ops: ops that run eagerly between the piecewise graphs (``"ns::name"`` as
            registered with ``torch.library``, ``torch.ops.ns.name`` or a callable);
            required by the modes with PIECEWISE, ignored (with a warning) by FULL.
        max_tokens: the largest batch (tokens) the engine schedules.
        query_len: tokens per request of the uniform batches the FULL graphs serve
            (1 for decode, ``1 + k`` to verify ``k`` speculative tokens).
        full_sizes, piecewise_sizes, full_mixed: as for :class:`~graphguard.DispatchPlan`.
        eager: what runs batches the plan sends to eager (default ``step``).
        backend_factory: makes one graph backend per runner (default CUDA);
            ``graphguard.RecordingBackend`` runs every mode's plumbing on a CPU.
        fullgraph: passed to the piecewise ``torch.compile``.
        options, and every option keyword (:class:`~graphguard.CaptureOptions`): for
            both runners, as for :class:`~graphguard.GraphRunner` (``fill_values``,
            ``names``, ``before_capture``, ``workspaces``, ``state``, ...), except
            ``sizes``, ``max_size`` and ``batch_dims``, which the plan and the one-row-
            per-token layout decide; ``name`` (default: the step's name) becomes
            ``<name>.full`` and ``<name>.piecewise``; ``sanitize`` applies to the FULL
            runner (the sanitizer watches whole-callable graphs).

    Then ``d.capture()``, ``print(d.table())`` and ``d(BatchKey.decode(reqs, q), *inputs)``
    or ``d(BatchKey.mixed(tokens, reqs), *inputs)``.
    """
    m = Mode.parse(mode)
    factory = "a callable returning a GraphBackend (e.g. graphguard.RecordingBackend, the class)"
    bad = failed(
        [
            ("step", step, callable(step), "a callable"),
            ("fullgraph", fullgraph, isinstance(fullgraph, bool), FLAG),
            ("backend_factory", backend_factory, _maybe(backend_factory), factory),
            ("eager", eager, _maybe(eager), "a callable (default: the step)"),
        ]
    )
    if bad:
        raise ConfigError("build_dispatcher: " + "; ".join(bad))
    ops = _as_split_ops(split_ops)
    inputs = _check_inputs(example_inputs)
    if "backend" in kwargs:
        raise ConfigError(
            "build_dispatcher does not take backend=: pass backend_factory= (one backend "
            "per runner, e.g. graphguard.RecordingBackend)"
        )
    opts = CaptureOptions.merge(options, where="build_dispatcher", **kwargs)
    for key, fix in _SET_HERE.items():
        if getattr(opts, key) is not None:
            raise ConfigError(f"build_dispatcher does not take {key}=: {fix}")
    label = opts.name or getattr(step, "__name__", None) or type(step).__name__
    # The plan validates max_tokens, query_len, the sizes and full_mixed (one wording).
    plan = DispatchPlan(
        m,
        max_tokens=max_tokens,
        full_sizes=full_sizes,
        piecewise_sizes=piecewise_sizes,
        query_len=query_len,
        full_mixed=full_mixed,
        name=label,
    )
    if m.has_piecewise and not ops:
        raise ConfigError(
            f"mode {m.name} needs split_ops: the ops that run eagerly between the piecewise "
            "graphs (e.g. split_ops=['mylib::attention'], your attention op as registered "
            "with torch.library). Without any, use mode='full'"
        )
    if m is Mode.FULL and ops:
        logger.warning(
            "build_dispatcher: split_ops %s are ignored in mode FULL (FULL graphs capture "
            "the whole step, split ops included); use mode='full_and_piecewise' to run "
            "mixed batches on piecewise graphs",
            [str(o) for o in ops],
        )

    def backend() -> GraphBackend | None:
        return backend_factory() if backend_factory is not None else None

    full: GraphRunner | None = None
    piecewise: PiecewiseRunner | None = None
    if m.has_full:
        full = GraphRunner(
            step,
            inputs,
            sizes=plan.full_sizes,
            backend=backend(),
            options=dataclasses.replace(opts, name=f"{label}.full"),
        )
    if m.has_piecewise:
        # The sanitizer watches whole-callable graphs only: it applies to the FULL runner.
        piecewise = PiecewiseRunner(
            step,
            inputs,
            split_ops=ops,
            fullgraph=fullgraph,
            sizes=plan.piecewise_sizes,
            backend=backend(),
            options=dataclasses.replace(opts, name=f"{label}.piecewise", sanitize=None),
        )
    return Dispatcher(
        plan, eager=eager if eager is not None else step, full=full, piecewise=piecewise
    )
