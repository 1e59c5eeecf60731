"""HF's continuous-batching engine put through graphguard: on this model instance only.

``model.init_continuous_batching`` is patched while :func:`installed` is open; each
manager it returns has its batch-processor factory wrapped (:func:`wrap_manager`), and
each processor's ``ModelRunner`` gets graphguard's ``compute_batch`` (:func:`install`).
HF's own CUDA graphs and async batching are refused (:func:`check_cb_config`): one step
has one graph owner. No transformers class is patched.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from transformers.generation.configuration_utils import ContinuousBatchingConfig

from graphguard.errors import ConfigError, UnsupportedModelError
from graphguard.integrations import _hf_cb_keys as keys

if TYPE_CHECKING:
    from graphguard.integrations._hf_cb_step import StepGraphs

logger = logging.getLogger("graphguard")


def check_cb_config(cfg: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """A copy of ``cfg`` with HF's own graphs and async batching off; refuses settings
    that would give one step two graph owners or an ungraphed path."""
    cfg = copy.deepcopy(cfg) if cfg is not None else ContinuousBatchingConfig()
    use = cfg.use_cuda_graph
    if use is True or (isinstance(use, (tuple, list)) and any(use)):
        raise ConfigError(
            f"graph_continuous_batching: continuous_batching_config.use_cuda_graph={use!r}: "
            "graphguard captures the steps; HF capturing them too would give one step two "
            "graph owners. Pass use_cuda_graph=False or leave it None"
        )
    if cfg.use_async_batching:
        raise ConfigError(
            "graph_continuous_batching: use_async_batching=True is not supported (its two IO "
            "pairs and in-graph carry-over are not graphed here yet); pass "
            "use_async_batching=False or leave it None"
        )
    for name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(cfg, name, None) is not None:
            raise ConfigError(
                f"graph_continuous_batching: continuous_batching_config.{name} is set; "
                "graphguard graphs HF's eager step (compiled steps are not supported here); "
                f"pass {name}=None"
            )
    cfg.use_cuda_graph = False
    cfg.use_async_batching = False
    return cfg


def install(
    processor: Any,
    manager: Any,
    new_steps: Callable[[Any], StepGraphs],
    engines: list[StepGraphs],
    version: str,
) -> None:
    """Put ``processor``'s steps through graphguard (once per processor): its
    ``ModelRunner``'s ``compute_batch`` replaced by the step graphs ``new_steps(runner)``
    makes, appended to ``engines``."""
    if getattr(processor, "_graphguard_steps", None) is not None:
        return
    mr, io = processor.model_runner, processor.inputs_and_outputs
    _refuse_unsupported(mr, io, version)
    # HF pads steps to static shapes only when it graphs or compiles them: turn its
    # padding on (pow2 max_length_k too), never its own capture (compute_batch is ours).
    mr.pad_inputs = True
    io.use_cuda_graph_varlen = True
    mr.use_cuda_graph_varlen = True
    mr.use_cuda_graph_decode = True
    # HF's warmup (which HF runs only when it graphs, so only because pad_inputs is on
    # now) steps a synthetic batch of max_batch_tokens queries over the whole cache to
    # capture HF's largest keys first. Under graphguard a key's first call is its eager
    # warmup (graphguard.lazy), so that step would run eagerly, sampling from an
    # uninitialized cache (on the H200, a 0.5B bf16 model's warmup hit torch's
    # "probability tensor contains inf, nan" device assert, which kills the CUDA
    # context), and capture nothing; off CUDA it cost minutes. Skipped (this instance):
    # each key is warmed by its first real step and captured at its second.
    mr.warmup = no_warmup
    steps = new_steps(mr)
    steps.capture()
    # Weak: the engines list must not keep HF's paged cache alive past its manager.
    steps.processor_ref = weakref.ref(processor)
    steps.manager_ref = weakref.ref(manager)
    mr.compute_batch = steps.compute_batch  # this instance only
    processor._graphguard_steps = steps
    engines.append(steps)


def _refuse_unsupported(mr: Any, io: Any, version: str) -> None:
    """A ``ModelRunner`` or IO lacking an internal graphguard uses, async batching, or a
    step HF compiled: refused before anything is patched."""
    for obj, attrs, what in (
        (mr, keys.RUNNER_ATTRS, "ModelRunner"),
        (io, keys.IO_ATTRS, "continuous batching IO"),
    ):
        why = keys.missing_internals(obj, attrs, what, version)
        if why:
            raise UnsupportedModelError(why, reasons=(why,))
    if type(io).__name__ != "ContinuousBatchingIOs":
        raise ConfigError(
            f"graph_continuous_batching: HF built {type(io).__name__} (async batching); "
            "only synchronous batching is graphed: use_async_batching=False"
        )
    if getattr(mr, "_compiled_varlen", None) or getattr(mr, "_compiled_decode", None):
        raise ConfigError(
            "graph_continuous_batching: HF compiled the step (a compile config from the "
            "generation config or default_compile_level); graphguard graphs the eager "
            "step: leave the compile configs unset"
        )


def wrap_manager(
    manager: Any, owner: object, install_on: Callable[[Any, Any], None], version: str
) -> Any:
    """``manager`` with every batch processor it creates (and the one it has) passed to
    ``install_on(processor, manager)``; once per ``owner``."""
    why = keys.missing_internals(manager, keys.MANAGER_ATTRS, "ContinuousBatchingManager", version)
    if why:
        raise UnsupportedModelError(why, reasons=(why,))
    if getattr(manager, "_graphguard_owner", None) is owner:
        return manager
    create = manager._create_batch_processor

    def create_batch_processor() -> Any:
        processor = create()
        install_on(processor, manager)
        return processor

    manager._create_batch_processor = create_batch_processor
    manager._graphguard_owner = owner
    if manager.batch_processor is not None:  # built before this wrapper saw it
        install_on(manager.batch_processor, manager)
    return manager


@contextlib.contextmanager
def installed(model: Any, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While open, every manager ``model.init_continuous_batching`` returns is passed to
    ``wrap`` (its config checked first, :func:`check_cb_config`). Patches the model
    instance only, never a transformers class."""
    if "init_continuous_batching" in vars(model):
        raise ConfigError(
            f"graph_continuous_batching: {type(model).__name__}.init_continuous_batching "
            "is already patched on this instance (another graph_continuous_batching "
            "still open?); one at a time per model"
        )
    original = model.init_continuous_batching

    def init_continuous_batching(
        generation_config: Any = None,
        continuous_batching_config: Any = None,
        workload_hints: Any = None,
        **kw: Any,
    ) -> Any:
        cfg = check_cb_config(continuous_batching_config)
        manager = original(
            generation_config=generation_config,
            continuous_batching_config=cfg,
            workload_hints=workload_hints,
            **kw,
        )
        return wrap(manager)

    model.init_continuous_batching = init_continuous_batching
    try:
        yield
    finally:
        del model.init_continuous_batching


def no_warmup(model: Any) -> None:
    """HF's ``ModelRunner.warmup`` under graphguard: skipped (see :func:`install`)."""
    logger.info(
        "graph_continuous_batching: HF's warmup skipped (each key's first real step is its "
        "warmup, its second captures it)"
    )


__all__ = ["check_cb_config", "install", "installed", "no_warmup", "wrap_manager"]
