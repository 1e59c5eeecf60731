"""Hugging Face continuous batching with its forward steps through graphguard, no model edits.

HF's continuous-batching engine (``model.generate_batch``, ``ContinuousBatchingManager``,
what ``transformers serve`` runs) schedules requests over a paged KV cache and calls
``ModelRunner.compute_batch(model, batch_data)`` once per step, on inputs HF pads to
static shapes. With ``use_cuda_graph`` HF captures that step itself, keyed by the padded
query tokens and KV length: no arena lock, no state restore, no memory budget or ledger,
no canary, no weight-update story, and a key that holds only those integers (a Python value
outside it is replayed at its capture value). Here HF still schedules, pads, samples and
owns the cache; the step goes through a :class:`~graphguard.GraphRunner`
(:mod:`._hf_cb_step`): a graph per key, captured on first use with graphguard's lifecycle
(``lazy=gg.Lazy(budget=...)``), keyed by **every** Python value and tensor layout the step
is handed (:mod:`._hf_cb_keys`), ``canary=`` and ``update_weights`` between calls::

    cb = GraphedContinuousBatching(model, lazy=gg.Lazy(budget=4 << 30))
    out = cb.generate_batch(prompts, generation_config=gen, max_new_tokens=64)
    cb.update_weights(new_state_dict)       # in place; the same graphs serve the new weights,
                                            # HF's prefix cache (old-weight KV) is dropped
    out = cb.generate_batch(prompts, generation_config=gen)
    cb.close()

``graph_continuous_batching(model, ...)`` is the same as a context manager for managers
built inside it (``model.init_continuous_batching()``, ``transformers serve``'s engine).

What is refused, with the reason (never a wrong result): transformers outside >= 5.17,
< 6 or with a changed internal (:class:`~graphguard.errors.UnsupportedModelError` naming
the version); ``use_cuda_graph=True`` (two graph owners of one step); async batching and
HF's compile configs (not graphed here yet); a step argument that cannot key a graph; a
later ``generate_batch`` with different generation or batching settings than the engine
was built for (HF would silently reuse the old engine); a weight update while requests
hold blocks of a running manager with block sharing on (:mod:`._hf_cb_prefix`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

try:
    import transformers as _transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "graphguard.integrations.hf_continuous needs transformers: "
        'pip install "transformers>=5.17,<6" (or, in a graphguard checkout, '
        'pip install ".[transformers]")'
    ) from exc

from typing_extensions import Unpack

from graphguard.config import CaptureKwargs, CaptureOptions, Lazy, option_keywords
from graphguard.errors import ConfigError, UnsupportedModelError
from graphguard.integrations import _hf_cb_install as install
from graphguard.integrations import _hf_cb_keys as keys
from graphguard.integrations import _hf_cb_prefix as prefix
from graphguard.integrations import _hf_cb_requests as requests
from graphguard.integrations._hf_cb_step import StepGraphs

TRANSFORMERS_VERSION: str = _transformers.__version__

logger = logging.getLogger("graphguard")

_SET_HERE = {
    "sizes": "one graph slot per step key: pass max_graphs=",
    "max_size": "one graph slot per step key: pass max_graphs=",
    "batch_dims": "HF pads each step itself; graphguard never pads it",
    "fill_values": "HF pads each step itself; graphguard never pads it",
    "names": "the step takes HF's batch_data",
    "state": "the step's declared state is HF's output_ids (see _hf_cb_step)",
    "weights": "update_weights()/check_weights() cover the model, by its HF names",
}


def support_problems(model: Any) -> list[str]:
    """Why this model/transformers pair cannot run continuous batching under graphguard."""
    problems = []
    bad = keys.version_problem(TRANSFORMERS_VERSION)
    if bad:
        problems.append(bad)
    for attr in ("init_continuous_batching", "generate_batch"):
        if not callable(getattr(model, attr, None)):
            problems.append(
                f"{type(model).__name__} has no {attr}() in transformers "
                f"{TRANSFORMERS_VERSION}: not a model with HF continuous batching"
            )
    return problems


class GraphedContinuousBatching:
    """HF continuous batching for ``model`` with every forward step through graphguard.

    Args:
        model: a transformers causal LM with continuous batching (``generate_batch``);
            its attention is what HF's engine picks (``sdpa``, ``paged|eager``, flash).
        max_graphs: the most step keys given a graph (slots of the runner's ladder);
            later new keys run HF's step eagerly. HF's padding (``q_padding_interval_size``,
            ``kv_padding_interval_size`` of the ``ContinuousBatchingConfig``) decides how
            many keys a workload has.
        mode: ``"full"`` (graphs) or ``"none"`` (the same hooks, HF's step eagerly).
        sanitize, backend: passed to the step's :class:`~graphguard.GraphRunner`
            (``backend=gg.RecordingBackend()`` emulates capture and replay on a CPU).
        options: a :class:`~graphguard.CaptureOptions`; option keywords beside it win.
            Read here: ``lazy`` (default ``gg.Lazy()``: each key captured on first use;
            ``Lazy(budget=...)`` caps the graphs' device memory, pool plus driver;
            ``lazy=False`` and ``capture_now`` are refused: a key exists only once HF
            builds a batch, so none can be captured before serving; a
            ``CaptureOptions(lazy=False)`` reads as unset, lazy), ``canary``,
            ``provenance``, ``warmup_iters``, ``capture_error_mode``, ``progress``,
            ``name``.
            ``sizes``, ``max_size``, ``batch_dims``, ``fill_values``, ``names``,
            ``state`` and ``weights`` are set here (a :class:`ConfigError` says why).

    Contract: one engine (HF's persistent manager) serves every :meth:`generate_batch`
    call, so its graphs do too; :meth:`update_weights` between calls loads in place and
    proves the graphs read the new values; :meth:`close` releases HF's engine and the
    graphs. Errors raised inside HF's generation thread are raised again by
    :meth:`generate_batch` (HF itself only logs them and returns partial results); the
    step that raised leaves no graph or key behind (:mod:`._hf_cb_step`), so the engine
    serves the next call correctly. HF's warmup (a synthetic step of
    ``max_batch_tokens`` queries over the whole cache, to capture HF's largest keys first)
    is skipped: a key's first real step is its warmup and its second captures it.
    """

    @option_keywords
    def __init__(
        self,
        model: Any,
        *,
        max_graphs: int = 128,
        mode: str = "full",
        sanitize: bool | None = None,
        backend: Any = None,
        options: CaptureOptions | None = None,
        **kwargs: Unpack[CaptureKwargs],
    ) -> None:
        if kwargs.get("lazy") is False:
            raise ConfigError(
                "GraphedContinuousBatching(lazy=False): a step key exists only once HF builds "
                "a batch (its padded sizes, its buffers, its Python values), so no key can be "
                "captured before serving; every key is captured on its first step. Leave "
                "lazy unset, or pass lazy=gg.Lazy(budget=...) to cap the graphs' memory; "
                "HF's warmup (generate_batch(warmup=True), on CUDA) captures its largest keys "
                "up front"
            )
        opts = CaptureOptions.merge(options, where="GraphedContinuousBatching", **kwargs)
        for key, fix in _SET_HERE.items():
            if getattr(opts, key) is not None:
                raise ConfigError(f"GraphedContinuousBatching sets {key}= itself: {fix}")
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 2:
            raise ConfigError(
                f"GraphedContinuousBatching: max_graphs must be an int >= 2, got {max_graphs!r}"
            )
        lazy = opts.lazy if opts.lazy is not None else Lazy()
        if lazy.capture_now:
            raise ConfigError(
                "GraphedContinuousBatching: Lazy(capture_now=...) names ladder sizes, and "
                "step keys exist only once HF builds a batch; HF's warmup (generate_batch's "
                "warmup=True) captures the largest keys up front instead"
            )
        problems = support_problems(model)
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems)
            raise UnsupportedModelError(
                f"GraphedContinuousBatching cannot graph {type(model).__name__} "
                f"(transformers {TRANSFORMERS_VERSION}):\n{listed}",
                reasons=tuple(problems),
            )
        self.model = model
        self.max_graphs = max_graphs
        self._opts = dataclasses.replace(opts, lazy=lazy)
        self._mode, self._sanitize, self._backend = mode, sanitize, backend
        self.engines: list[StepGraphs] = []
        """One per HF batch processor (paged cache) set up so far, newest last."""
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._settings: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------ install
    # (graphguard.integrations._hf_cb_install: what is patched, on this instance only)

    def _on_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def raise_errors(self) -> None:
        """Raise the first error a step raised in HF's generation thread since the last
        call, if any (HF's own ``generate_batch`` only logs them)."""
        self._raise_recorded()

    def _raise_recorded(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _install(self, processor: Any, manager: Any) -> None:
        """Put ``processor``'s steps through graphguard (once per processor)."""
        install.install(processor, manager, self._new_steps, self.engines, TRANSFORMERS_VERSION)

    def _new_steps(self, model_runner: Any) -> StepGraphs:
        return StepGraphs(
            model_runner,
            self.model,
            max_graphs=self.max_graphs,
            options=self._opts,
            mode=self._mode,
            backend=self._backend,
            sanitize=self._sanitize,
            on_error=self._on_error,
        )

    def _wrap_manager(self, manager: Any) -> Any:
        return install.wrap_manager(manager, self, self._install, TRANSFORMERS_VERSION)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While open, every manager ``model.init_continuous_batching`` returns (and so
        ``generate_batch`` and ``continuous_batching_context_manager``) steps through
        graphguard. Patches the model instance only, never a transformers class."""
        with install.installed(self.model, self._wrap_manager):
            yield

    # ------------------------------------------------------------------ generate

    def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        generation_config: Any = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``model.generate_batch(...)`` (same arguments and results) on one persistent
        engine whose steps replay graphs. The engine is built for the settings of the
        first call; a later call with other ``generation_config`` /
        ``continuous_batching_config`` values is a :class:`ConfigError` (``close()``
        first), where HF would silently keep the first engine.

        ``inputs`` are checked first (:func:`._hf_cb_requests.check_prompts`): a list of
        prompts, each a non-empty list of int token ids inside the model's vocabulary (or
        a 1-D integer tensor); anything else is a :class:`ConfigError` naming
        ``inputs[i][j]``, before anything runs. An empty prompt is refused rather than
        returned FAILED as HF does: this method raises for any failed request.
        ``max_new_tokens`` may be one int per prompt (RL rollouts, mixed budgets): HF's
        manager then gets one ``add_request`` each. A step that raises fails the call
        (the error raised here) and leaves no graph or key behind: the next call runs
        correctly on the same engine."""
        where = "GraphedContinuousBatching.generate_batch"
        if kwargs.get("persistent_manager") is False:
            raise ConfigError(
                f"{where} keeps one engine (its graphs) across calls: persistent_manager=False "
                "would drop them; use graph_continuous_batching(model) for one-shot managers"
            )
        kwargs["persistent_manager"] = True
        prompts = requests.check_prompts(inputs, requests.vocabulary(self.model), where)
        if not prompts:
            return {}
        new_tokens = kwargs.get("max_new_tokens")
        each = None  # one int for all (or unset): HF's own form
        if new_tokens is not None:
            each = requests.check_new_tokens(new_tokens, len(prompts), where)
        install.check_cb_config(continuous_batching_config)  # refused before anything is kept
        settings = (_settings_of(generation_config), _settings_of(continuous_batching_config))
        if self._settings is not None and settings != self._settings:
            raise ConfigError(
                f"{where}: generation_config / continuous_batching_config differ from the "
                "first call's, and HF reuses the engine built for those (its cache, batching "
                "and sampling); call close() first to build a new engine"
            )
        self._settings = settings
        self._raise_recorded()
        self._raise_if_moved()
        with self.installed():
            if each is None:
                out: dict[str, Any] = self.model.generate_batch(
                    prompts,
                    generation_config=generation_config,
                    continuous_batching_config=continuous_batching_config,
                    **kwargs,
                )
            else:
                out = requests.generate_each(
                    self.model,
                    prompts,
                    each,
                    generation_config=generation_config,
                    continuous_batching_config=continuous_batching_config,
                    warmup=kwargs.get("warmup", True),
                    record_timestamps=kwargs.get("record_timestamps", False),
                )
        self._raise_recorded()
        failed = [r for r in out.values() if getattr(r, "error", None) is not None]
        if failed or len(out) < len(prompts):
            raise RuntimeError(
                f"{where}: {len(failed)} request(s) failed and "
                f"{max(0, len(prompts) - len(out))} missing in HF's engine (first error: "
                f"{failed[0].error if failed else 'none'}); see HF's log"
            )
        return out

    # ------------------------------------------------------------------ serving

    @property
    def steps(self) -> StepGraphs | None:
        """The newest engine's step graphs (None before the first step)."""
        return self.engines[-1] if self.engines else None

    def update_weights(self, source: Any, *, on_moved: str = "raise", strict: bool = True) -> Any:
        """Load new weights in place between ``generate_batch`` calls, all or nothing, and
        prove every graph reads them (:meth:`graphguard.GraphRunner.update_weights`):
        Hugging Face names, a model of the same architecture, a loader callable, or a
        ``.safetensors`` file or directory. Before any graph exists: a plain in-place load.

        **HF's prefix cache is dropped.** HF's paged cache keeps the hashes of the full
        pages of KV its requests computed (``allow_block_sharing``, on by default) across
        ``generate_batch`` calls, and a later prompt with the same first tokens re-uses
        those blocks: KV of the weights they were computed with. So after the load every
        block hash of every engine's paged cache (and of the model's cached HF manager) is
        forgotten and the blocks kept only for them go back to the free pool; the next
        call recomputes its prompts with the new weights (within a call, sharing works as
        before). Dropped also when the load fails (a cache costs only a recomputation).
        Refused before anything is loaded (:class:`ConfigError`): requests holding blocks
        in a running manager while block sharing is on (their pages would be hashed again
        with old-weight KV; update between requests, or ``allow_block_sharing=False``);
        a paged cache whose prefix-cache internals this transformers version lacks
        (:class:`UnsupportedModelError` naming the version)."""
        from graphguard.integrations._hf_weights import hf_names, load_safetensors
        from graphguard.weights import update_weights

        caches = self._prefix_caches()  # refusals come before anything is loaded
        if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
            source = load_safetensors(source)
        if isinstance(source, dict):
            source = hf_names(self.model, source)
        runners = [e.runner for e in self.engines]
        try:
            if runners:
                return update_weights(
                    [r.door for r in runners], source, on_moved=on_moved, strict=strict
                )
            if isinstance(source, dict):
                with torch.no_grad():
                    self.model.load_state_dict(source, strict=strict)
            elif isinstance(source, torch.nn.Module):
                with torch.no_grad():
                    self.model.load_state_dict(source.state_dict(), strict=strict)
            else:
                source()
            return None
        finally:
            self._drop_prefix_caches(caches)

    def refit(self, **kw: Any) -> Any:
        """``with engine.refit() as r: my_loader(engine.model)`` between ``generate_batch``
        calls: every tensor the step graphs read classified on exit, a graph-read weight
        the loader did not write raised by name (:meth:`graphguard.GraphRunner.refit`,
        same keywords); HF's prefix cache is dropped on exit, as :meth:`update_weights`
        drops it (its refusals come first)."""
        from graphguard.weights.update import refit

        caches = self._prefix_caches()  # refusals come before anything is loaded
        return refit(
            [e.runner.door for e in self.engines],
            after=lambda: self._drop_prefix_caches(caches),
            **kw,
        )

    def weight_sync(self, source: torch.nn.Module, *, strict: bool = True) -> Any:
        """A :class:`~graphguard.integrations._hf_cb_sync.WeightSync` from the trainer's
        ``source`` module (same architecture and dtype) into this engine's model: validated
        now, as :meth:`update_weights` validates a source (nothing is copied yet); each
        ``sync()`` then re-proves in microseconds that no source or engine tensor was
        re-created (else runs the full :meth:`update_weights`), copies with one fused copy
        per device pair, synchronizes, and drops HF's prefix cache. For an RL loop that
        pushes the same trainer tensors after every optimizer step: the validation and the
        address proof of :meth:`update_weights` cost milliseconds of Python per call, the
        copy of a 0.5B bf16 model well under one on an H200. Returns what
        :meth:`update_weights` returns (a ``WeightUpdate``)."""
        from graphguard.integrations._hf_cb_sync import WeightSync

        return WeightSync(
            self, source, strict=strict, caches=self._prefix_caches, drop=self._drop_prefix_caches
        )

    def _prefix_caches(self) -> list[tuple[Any, bool]]:
        """:func:`._hf_cb_prefix.engine_caches` of this model's engines."""
        return prefix.engine_caches(self.engines, self.model, TRANSFORMERS_VERSION)

    def _drop_prefix_caches(self, caches: list[tuple[Any, bool]]) -> None:
        prefix.drop_all(caches, TRANSFORMERS_VERSION)

    def _raise_if_moved(self) -> None:
        """Once per call, never per step: each engine's graphs against the addresses they
        recorded (``WeightsMovedError`` naming the tensors and the fix, as
        ``GraphedCausalLM.generate``): a replaced submodule or a re-created weight would
        otherwise be served from the graphs' old storage."""
        for e in self.engines:
            if e.runner.captured_sizes:
                e.runner.check_weights().raise_if_moved()

    def check_weights(self) -> list[Any]:
        """Each engine's :meth:`~graphguard.GraphRunner.check_weights`."""
        return [e.runner.check_weights() for e in self.engines]

    def audit(self) -> list[Any]:
        """Each engine's :meth:`~graphguard.GraphRunner.audit`: what each step graph reads,
        by owner (with ``provenance=True``), and the reads whose owner moved since."""
        return [e.runner.audit() for e in self.engines]

    def stats(self) -> dict[str, Any]:
        """The newest engine's per-key table (:meth:`StepGraphs.stats`), or ``{}``."""
        return self.steps.stats() if self.steps is not None else {}

    def canary_stats(self) -> Any:
        """The newest engine's canary counters (``runner.canary_stats()``)."""
        return self.steps.runner.canary_stats() if self.steps is not None else {}

    def close(self) -> None:
        """Release the graphs and HF's persistent engine (its paged cache)."""
        for e in self.engines:
            e.release()
        self.engines.clear()
        self._settings = None
        destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
        if callable(destroy):
            destroy()

    def __enter__(self) -> GraphedContinuousBatching:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settings_of(cfg: Any) -> Any:
    """A comparable form of a generation / batching config (None stays None)."""
    if cfg is None:
        return None
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        return repr(sorted(to_dict().items(), key=lambda kv: kv[0]))
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return repr(dataclasses.asdict(cfg))
    return repr(vars(cfg))


@contextlib.contextmanager
def graph_continuous_batching(model: Any, **kwargs: Any) -> Iterator[GraphedContinuousBatching]:
    """While open, HF continuous-batching managers built for ``model`` step through
    graphguard (``model.generate_batch``, ``model.init_continuous_batching()``, the engine
    of ``transformers serve`` in this process); on exit their graphs are released.
    Keywords: :class:`GraphedContinuousBatching`'s. HF's own ``generate_batch`` swallows
    errors from its generation thread: read them back with ``g.raise_errors()``."""
    g = GraphedContinuousBatching(model, **kwargs)
    with g.installed():
        try:
            yield g
        finally:
            for e in g.engines:
                e.release()
    g._raise_recorded()


__all__ = [
    "TRANSFORMERS_VERSION",
    "GraphedContinuousBatching",
    "graph_continuous_batching",
    "support_problems",
]
