"""Graphed generation for stock Hugging Face ``transformers`` causal LMs, no model edits.

``GraphedCausalLM(model, max_batch=B, max_cache_len=L)`` builds one ``StaticCache`` of
``B`` rows and a decode step over it, wrapped in a :class:`~graphguard.GraphRunner` over
``capture_sizes(B)``. ``capture()`` captures the ladder and leaves the cache and its
counters as it found them. ``generate(...)`` prefills eagerly (left-padded prompts: all
rows share one write position), then decodes with graph replays and returns what
``model.generate(..., cache_implementation="static")`` returns for the same inputs and
settings (token ids ``[B, prompt + new]``, finished rows padded with ``pad_token_id``)::

    g = GraphedCausalLM(model, max_batch=32, max_cache_len=1024)   # model in eval mode
    g.capture()                                                    # the ladder 1..32
    out = g.generate(input_ids, attention_mask, max_new_tokens=128)

Contract: what cannot be graphed token-identically is refused before anything is
captured, by :class:`~graphguard.errors.UnsupportedModelError` naming the reason and the
eager fallback (:meth:`GraphedCausalLM.supported` asks without raising; the list is in
:mod:`._hf_support`). ``generate`` checks its arguments as HF's does (:mod:`._hf_generate`)
before anything runs on the device, and refuses (:mod:`._hf_guards`) a model put back in
training mode or graphs whose parameters or buffers moved since capture.

Warmup and capture take the same path: the model call over the cache, with a mask built
on the device (:mod:`._hf_decode`); no torch function is patched.

``compile=True``: the decoder block is compiled once by Inductor, without its CUDA graphs,
and serves every layer and size (:mod:`._hf_blocks`); ``compile="model"`` compiles the
whole model call. ``verify()``: :mod:`._hf_verify`.

Why not plug into ``model.generate``: it sizes its ``StaticCache`` to the prompt batch,
rebuilds the mask on the host every step and decides when to stop on the host; this class
owns the loop and keeps the host out of it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "graphguard.integrations.transformers needs transformers: "
        'pip install "transformers>=5.17,<6" (or, in a graphguard checkout, '
        'pip install ".[transformers]")'
    ) from exc

from typing_extensions import Unpack

from graphguard import CaptureReport, GraphRunner, phase, verify
from graphguard.compiled import CompiledStep
from graphguard.config import CaptureKwargs, CaptureOptions, option_keywords
from graphguard.errors import GraphGuardError, UnsupportedModelError
from graphguard.integrations import _hf_guards as guards
from graphguard.integrations import _hf_support as support
from graphguard.integrations._hf_blocks import BlockCompile, compiled_decode
from graphguard.integrations._hf_decode import StaticDecode
from graphguard.integrations._hf_decode_options import decode_options, decode_sizes
from graphguard.integrations._hf_generate import (
    FROM_CONFIG,
    FromConfig,
    generate_inputs,
)
from graphguard.integrations._hf_sampling import Sampler, decode_tokens
from graphguard.integrations._hf_verify import VerifyView
from graphguard.report import VerifyReport
from graphguard.state import StateSet

logger = logging.getLogger("graphguard")

Support = support.Support
TRANSFORMERS_VERSION: str = _transformers.__version__
COMPILE_MODES = support.COMPILE_MODES


class GraphedCausalLM:
    """A transformers causal LM whose decode step replays CUDA graphs.

    Args:
        model: a decoder-only ``PreTrainedModel`` with a LM head, in eval mode.
        max_batch: rows of the one ``StaticCache``; the largest batch ``generate`` takes.
        max_cache_len: cache length; prompt length + ``max_new_tokens`` must fit.
        mode: ``"full"`` (graphs) or ``"none"`` (the same loop eagerly, e.g. on a CPU).
        share_outputs, sanitize, backend: passed to the decode :class:`GraphRunner`.
        stop_check_every: with EOS ids, read "all rows finished?" on the host every this
            many steps (the only host sync of the loop).
        compile: capture Inductor-compiled decode steps (fused kernels, no Inductor CUDA
            graphs) instead of HF's eager kernels, from one compile (the batch dimension
            symbolic) during the largest size's first warmup. ``True``: the decoder block,
            compiled once for every layer (``"blocks"`` insists on it, and raises
            :class:`ConfigError` saying why when the model has no block to compile
            alone); ``"model"``: the whole model call (longer compile, a few percent
            faster per token). ``capture()``'s report gives ``compiles``, ``compile_s``
            and ``recompiles``; :attr:`compile_scope` says which was compiled. Prefill and
            batches above the ladder stay eager; with ``sanitize=True`` or
            ``mode="none"`` nothing is compiled (see :mod:`graphguard.compiled`).
        compile_mode: the Inductor mode with ``compile=True``: ``None`` (default) or
            ``"max-autotune-no-cudagraphs"`` (longer compile, autotuned GEMMs).
        options: a :class:`~graphguard.CaptureOptions` for the decode runner; the option
            keywords given beside it win over its fields, as for :class:`GraphRunner`.
            What this class reads or sets itself:

            * ``sizes``: capture sizes, all ``<= max_batch`` (default
              ``capture_sizes(max_batch)``; with ``compile=True``,
              ``compiled_capture_sizes(max_batch)``: batch 1 pads to 2);
            * ``warmup_iters``: at least 1 (the warmups pin capture's cache writes to
              column 0);
            * ``canary``: a :class:`~graphguard.Canary` (``runner.canary_stats()``); its
              state is the whole static cache, cloned twice per check
              (:mod:`graphguard.canary`). Without ``rtol``/``atol`` it checks at the model
              dtype's tolerance (the float32 logits are copies of bf16 ones: bf16's 2e-2,
              not float32's);
            * ``lazy``: capture each batch size when ``generate`` first reaches it instead
              of all in :meth:`capture` (:mod:`graphguard.lazy`); with ``compile=True`` the
              one compile happens in ``capture()`` and sizes are captured as generation
              reaches them. :meth:`stats` says what happened;
            * ``name`` defaults to ``<model class>.decode``;
            * ``max_size``, ``batch_dims``, ``fill_values``, ``names``, ``state`` and
              ``weights`` are set here (a :class:`ConfigError` says what to pass instead).
    """

    @option_keywords
    def __init__(
        self,
        model: Any,
        *,
        max_batch: int,
        max_cache_len: int,
        mode: str = "full",
        share_outputs: bool = True,
        sanitize: bool | None = None,
        backend: Any = None,
        stop_check_every: int = 16,
        compile: bool | str = False,
        compile_mode: str | None = None,
        options: CaptureOptions | None = None,
        **kwargs: Unpack[CaptureKwargs],
    ) -> None:
        opts = CaptureOptions.merge(options, where="GraphedCausalLM", **kwargs)
        ladder, warmup_iters = decode_sizes(
            opts, max_batch, max_cache_len, stop_check_every, compile, compile_mode
        )
        self.raise_if_unsupported(model, max_cache_len=max_cache_len)
        self.model = model
        self.max_batch = max_batch
        self.max_cache_len = max_cache_len
        self.stop_check_every = stop_check_every
        self._call = StaticDecode(model, max_batch, max_cache_len, ladder)
        self.device, self.dtype = self._call.device, self._call.dtype
        self.cache = self._call.cache
        self.cache_state: StateSet = self._call.state
        """What capture and ``verify()`` restore: the counters and the cache columns a
        capture writes (the runner's ``state=``)."""
        self.compiled_step: CompiledStep | None = None
        """With ``compile``: the Inductor-compiled code that warmups and captures run (one
        decoder block, or the whole model call), with ``compiles``, ``compile_s`` and
        ``recompile_reasons``."""
        self.compile_scope: str | None = None
        """``"blocks"`` or ``"model"``: what ``compile`` compiled (None: nothing)."""
        self._blocks: BlockCompile | None = None
        if compile:
            self._compile(compile, compile_mode, ladder)
        examples = (
            torch.zeros((1, 1), dtype=torch.long, device=self.device),
            torch.zeros((1, 1), dtype=torch.long, device=self.device),
            torch.ones((1, max_cache_len), dtype=torch.bool, device=self.device),
        )
        self.runner = GraphRunner(
            self._step,
            examples,
            mode=mode,
            share_outputs=share_outputs,
            sanitize=sanitize,
            backend=backend,
            options=decode_options(
                opts,
                model,
                ladder=ladder,
                warmup_iters=warmup_iters,
                state=self.cache_state,
                dtype=self.dtype,
                compile=compile,
            ),
        )
        # The compiled decode serves the ladder (graph bodies), not the eager fallback above.
        full = compile and self.runner.mode.value == "full"
        self._compiled_sizes = frozenset(self.runner.sizes if full else ())

    def _compile(self, compile: bool | str, compile_mode: str | None, ladder: list[int]) -> None:
        """Compile the decode (one decoder block, or the whole model call)."""
        self.compiled_step, self._blocks = compiled_decode(
            self.model, self._call.decode, len(self.cache.layers), compile, compile_mode
        )
        self.compile_scope = "model" if self._blocks is None else "blocks"
        if 1 in ladder and len(ladder) > 1:
            logger.info(
                "GraphedCausalLM: compile with size 1 in sizes: Inductor may guard "
                "`size >= 2` and compile size 1 again (report.compiles says); sizes=None "
                "pads batch 1 to 2 instead"
            )

    # ------------------------------------------------------------ support

    @staticmethod
    def supported(model: Any, *, max_cache_len: int | None = None) -> Support:
        """Whether ``model`` can be graphed token-identically, and why not (no allocation).

        Pass ``max_cache_len`` to judge sliding windows (a window shorter than the cache
        is refused; one at least as long never slides and is graphed).
        """
        reasons = support.check(model, max_cache_len)
        return Support(not reasons, "; ".join(reasons))

    @staticmethod
    def raise_if_unsupported(model: Any, *, max_cache_len: int | None = None) -> None:
        """Raise :class:`UnsupportedModelError` with every reason and the eager fallback."""
        reasons = support.check(model, max_cache_len)
        if reasons:
            listed = "\n".join(f"  - {r}" for r in reasons)
            raise UnsupportedModelError(
                f"GraphedCausalLM cannot graph {type(model).__name__} token-identically "
                f"(transformers {TRANSFORMERS_VERSION}):\n{listed}\nNothing was captured; "
                f"{support.FALLBACK}.",
                reasons=tuple(reasons),
            )

    # ------------------------------------------------------------ the step

    def _step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_valid: torch.Tensor
    ) -> torch.Tensor:
        """One decode token for ``n`` rows over cache rows ``[0, n)``; float32 logits ``[n, V]``.

        What depends on Python values stays here, outside the compiled region: the phase
        and the row views of size ``n`` (a dict keyed by the int ``n``). The ladder's sizes
        run the compiled decode when there is one; the eager fallback runs the plain one.
        """
        if phase.current_phase() is phase.Phase.WARMUP and not phase.is_first_call():
            # Warmups really run: keep their writes in column 0 (see CacheState). A lazy
            # size's first call is a warmup too, but the request's own decode step.
            torch._foreach_zero_(self._call.counters)
        n = input_ids.shape[0]
        rows = self._call.rows(n)
        with torch.no_grad():
            if self.compiled_step is not None and n in self._compiled_sizes:
                if self._blocks is not None:
                    with self._blocks.active(rows, n):
                        return self._call.decode(input_ids, position_ids, kv_valid, rows)
                logits: torch.Tensor = self.compiled_step(input_ids, position_ids, kv_valid, rows)
                return logits
            return self._call.decode(input_ids, position_ids, kv_valid, rows)

    def eager_step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_valid: torch.Tensor
    ) -> torch.Tensor:
        """The decode step run eagerly and uncompiled over cache rows ``[0, n)``: what
        ``verify()`` compares the graphs with. It writes the cache like a replay does."""
        return self._call.eager(input_ids, position_ids, kv_valid)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embeddings: every id ``generate`` takes is below it."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    # ------------------------------------------------------------ capture

    @contextlib.contextmanager
    def cache_restored(self) -> Iterator[None]:
        """Give the KV cache back as it was when the block ends, even on failure (around
        a capture's, ``verify()``'s and a weight update's forwards). Inside the block the
        write position is 0, so every forward writes the columns the declared state
        covers (``cache_state``), wherever a generation left the counters."""
        with self._call.restored():
            yield

    def capture(self) -> CaptureReport:
        """Capture the ladder; the cache and its counters are left as they were. With
        ``compile=True`` the report gives the compiles, their seconds (in ``total_s``) and
        any recompile reasons."""
        guards.raise_if_training(self.model, "capture")
        with self.cache_restored(), guards.refuse_host_copies(self.model, self.runner):
            report = self.runner.capture()
        return self._with_compiles(report)

    def recapture(self, *, reason: str, only_moved: bool = False) -> CaptureReport:
        """Drop the graphs and capture again on purpose (e.g. weights replaced); with
        ``only_moved=True``, only the sizes whose graphs read a moved parameter or buffer
        (:meth:`graphguard.GraphRunner.recapture`). The cache is restored, as
        :meth:`capture` leaves it."""
        guards.raise_if_training(self.model, "recapture")
        with self.cache_restored(), guards.refuse_host_copies(self.model, self.runner):
            report = self.runner.recapture(reason=reason, only_moved=only_moved)
        return self._with_compiles(report)

    def update_weights(self, source: Any, *, on_moved: str = "raise", strict: bool = True) -> Any:
        """Load new weights into the captured parameters in place, all or nothing
        (:meth:`graphguard.GraphRunner.update_weights`): a state dict with Hugging Face
        names (base-model names are prefixed), a model of the same architecture, a
        loader callable, or a local ``.safetensors`` file or directory. A recapture
        (``on_moved="recapture"``) restores the cache, as :meth:`capture` does."""
        from graphguard.integrations import _hf_weights

        return _hf_weights.update(self, source, on_moved=on_moved, strict=strict)

    def refit(self, **kw: Any) -> Any:
        """``with lm.refit() as r: my_loader(lm.model)``: every tensor the graphs read
        classified on exit, a graph-read weight the loader did not write raised by name
        (:meth:`graphguard.GraphRunner.refit`, same keywords); a recapture restores the
        cache, as :meth:`capture` does."""
        from graphguard.integrations import _hf_weights

        return _hf_weights.refit(self, **kw)

    def check_weights(self) -> Any:
        """Prove without replaying that the graphs' parameters and buffers did not move
        (:meth:`graphguard.GraphRunner.check_weights`, Hugging Face names)."""
        return self.runner.check_weights()

    def audit(self) -> Any:
        """What each decode graph reads, by owner (:meth:`graphguard.GraphRunner.audit`,
        Hugging Face names)."""
        return self.runner.audit()

    def canary_stats(self) -> Any:
        """Per captured size, what the canary saw (:meth:`graphguard.GraphRunner.canary_stats`)."""
        return self.runner.canary_stats()

    def _with_compiles(self, report: CaptureReport) -> CaptureReport:
        """Fill the compile fields as ``GraphRunner(compile=True)`` does (cumulative)."""
        return guards.with_compiles(report, self.compiled_step, self.runner, repr(self))

    def _check_ready(self, where: str) -> None:
        """Once per call, never per token: captured, eval mode, weights where captured."""
        if self.runner.mode.value != "none" and not self.runner.serving:
            raise GraphGuardError(f"{where}: call capture() first (or build with mode='none')")
        guards.raise_if_training(self.model, where)
        if self.runner.captured_sizes:  # each graph against the addresses it recorded
            self.runner.check_weights().raise_if_moved()

    def verify(self, **kwargs: Any) -> VerifyReport:
        """Replay every captured size and compare with the eager, uncompiled model call
        (arguments of :func:`graphguard.verify`); the cache is left as it was."""
        if not self.runner.captured_sizes:
            raise GraphGuardError("verify: call capture() first")
        guards.raise_if_training(self.model, "verify")
        with self.cache_restored():  # the write position 0: the declared columns only
            view = VerifyView(self)
            kwargs.setdefault("make_inputs", view.inputs_maker(int(kwargs.get("seed", 0))))
            return verify(view, **kwargs)

    def estimate_graph_memory(self) -> int:
        """Bytes the ladder's graph pool will take (a throwaway profiling capture)."""
        return self.runner.estimate_graph_memory()

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a graph."""
        return self.runner.captured_sizes

    def stats(self) -> Any:
        """The decode runner's :meth:`~graphguard.GraphRunner.stats` (replays, eager
        batches, lazy captures, graph memory)."""
        return self.runner.stats()

    def release(self) -> None:
        """Drop the graphs (the cache stays)."""
        self.runner.release()

    # ------------------------------------------------------------ generate

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | FromConfig | None = FROM_CONFIG,
        do_sample: bool | FromConfig | None = FROM_CONFIG,
        temperature: float | FromConfig | None = FROM_CONFIG,
        top_k: int | FromConfig | None = FROM_CONFIG,
        top_p: float | FromConfig | None = FROM_CONFIG,
        min_p: float | FromConfig | None = FROM_CONFIG,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | FromConfig | None = FROM_CONFIG,
        pad_token_id: int | FromConfig | None = FROM_CONFIG,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Generate like ``model.generate(..., cache_implementation="static")``.

        ``input_ids`` ``[B, P]`` of integer ids below :attr:`vocab_size`, ``B <=
        max_batch``; ``attention_mask`` 0/1 of the same shape (default: inferred from
        ``pad_token_id`` as HF does). Right-padded rows are shifted to their left-padded
        equivalent (and returned so). Settings not passed come from the
        ``generation_config=`` keyword, else ``model.generation_config``, else HF's
        defaults (``do_sample=False``, ``top_k=50``, ...); ``None`` passed turns a warper
        off, as in HF. ``max_new_tokens`` unset anywhere: ``max_length - P`` when a
        ``max_length`` is set, else 20. Returns token ids ``[B, P + n]``: ``n`` new
        tokens, or fewer when every row emitted EOS. Sampling applies temperature, top-k,
        top-p and min-p; every other setting HF would act on (``num_beams=2``,
        ``repetition_penalty``, ...) is a :class:`ConfigError` naming it, and one the
        model's ``generation_config`` enables an :class:`UnsupportedModelError`. Bad
        values and ids are refused before anything runs on the device.
        """
        passed = {
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }
        settings, ids, mask2d, new = generate_inputs(
            self.model,
            passed,
            kwargs,
            generator,
            input_ids,
            attention_mask,
            vocab=self.vocab_size,
            max_batch=self.max_batch,
            max_cache_len=self.max_cache_len,
            device=self.device,
        )
        self._check_ready("generate")
        sampler = Sampler(settings, generator)
        with torch.no_grad():
            logits, positions = self._call.prefill(ids, mask2d)
            return decode_tokens(
                self.runner,
                logits,
                ids,
                mask2d,
                positions,
                settings,
                sampler,
                new=new,
                max_cache_len=self.max_cache_len,
                stop_check_every=self.stop_check_every,
            )

    def __repr__(self) -> str:
        return (
            f"GraphedCausalLM({type(self.model).__name__}, max_batch={self.max_batch}, "
            f"max_cache_len={self.max_cache_len}, captured={list(self.captured_sizes)})"
        )


__all__ = [
    "COMPILE_MODES",
    "FROM_CONFIG",
    "TRANSFORMERS_VERSION",
    "FromConfig",
    "GraphedCausalLM",
    "Support",
]
