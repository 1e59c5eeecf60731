"""A Llama-style decoder over a static KV cache, written the way an engine writes one.

Contract: :meth:`LlamaDecodeModel.decode_step` (one token per row, workspace arena,
auxiliary-stream branch) and :meth:`LlamaDecodeModel.mixed_step` (one row per token of
any prefill/decode/verify mix, plain out-of-place torch) are CUDA-graph capturable: no
host sync, no value-dependent shapes or branches. The KV cache is
``[max_batch + 1, kv_heads, max_context, head_dim]`` per layer. In ``decode_step`` **rows
are slots** (row ``b`` is the sequence in slot ``b``), so attention reads ``cache[:B]``, a
view, with no per-row gather; the ``slots`` input says where each row writes. The extra
*scratch slot* (``max_batch``) is where padded rows write
(:meth:`~LlamaDecodeModel.pad_fill_values`), so padding never touches a live sequence.
Per-step scratch comes from a :class:`~graphguard.workspace.Workspace` that must be
warmed at the largest batch before capture (:meth:`~LlamaDecodeModel.warm_kernels`,
the "arena growth after capture" hazard). Row-parallel projections go through
:meth:`~LlamaDecodeModel.row_parallel`, the one hook a tensor-parallel shard overrides.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphguard.errors import ConfigError
from graphguard.streams import AuxStream
from graphguard.workspace import Workspace
from graphguard_ref.llama import weights
from graphguard_ref.llama.config import LlamaConfig
from graphguard_ref.llama.ops import (
    apply_rope,
    attention,
    is_compiling,
    mixed_attention,
    rms_norm,
    rope_inv_freq,
    write_kv,
)


def _weight(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Inference only: no autograd graph, so decode_step needs no no_grad/inference_mode
    # (which would otherwise break torch.compile traces and graph capture symmetry).
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's fused weights and its static KV cache."""

    k_cache: Tensor
    v_cache: Tensor

    def __init__(self, config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.input_norm = _weight((d,), device, dtype)
        self.qkv_weight = _weight((config.q_size + 2 * config.kv_size, d), device, dtype)
        self.o_weight = _weight((d, config.q_size), device, dtype)
        self.post_norm = _weight((d,), device, dtype)
        self.gate_up_weight = _weight((2 * i, d), device, dtype)
        self.down_weight = _weight((d, i), device, dtype)
        # Head-major [slot, kv_head, position, hd]: cache[:B] is SDPA's key layout as is.
        cache_shape = (
            config.max_batch + 1,
            config.num_kv_heads,
            config.max_context,
            config.head_dim,
        )
        # Not persistent: the cache is runtime state, not part of a checkpoint.
        self.register_buffer(
            "k_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(cache_shape, device=device, dtype=dtype), persistent=False
        )


class LlamaDecodeModel(nn.Module):
    """Llama-style decoder that decodes one token per row against a static KV cache.

    Args:
        config: shapes and static limits.
        device, dtype: where and in which precision weights, cache and activations live.
        seed: seeds the random weights (std 0.02, norms 1, as HF initialises Llama).
            ``None`` leaves the weights uninitialised: only for loaders that
            overwrite every weight immediately (:meth:`from_pretrained`).
        overlap: run the RoPE/mask branch on an auxiliary stream (CUDA only; it still
            runs inline whenever ``graphguard.phase.overlap_allowed()`` is false).
        workspace: the scratch arena to draw per-step buffers from; pass the runner's
            arena to share one, else the model creates its own (:attr:`workspace`).

    Random weights are generated on ``device`` by a device generator, so the same seed
    gives the same weights on the same device type (CPU and CUDA weights differ).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int | None = 0,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.device = dev
        self.dtype = dtype
        self.overlap = overlap
        d = config.hidden_size
        self.embed_tokens = _weight((config.vocab_size, d), dev, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dev, dtype) for _ in range(config.num_layers)
        )
        self.norm = _weight((d,), dev, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight((config.vocab_size, d), dev, dtype)
        )
        # RoPE table for every position of the context, gathered by position per step.
        freqs = torch.outer(
            torch.arange(config.max_context, dtype=torch.float32), rope_inv_freq(config)
        )
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dev, dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dev, dtype), persistent=False)
        self.register_buffer(
            "_ctx_range",
            torch.arange(config.max_context, device=dev).view(1, 1, 1, -1),
            persistent=False,
        )
        self.register_buffer("_mask_keep", torch.zeros((), device=dev, dtype=dtype), False)
        self.register_buffer(
            "_mask_drop", torch.full((), float("-inf"), device=dev, dtype=dtype), False
        )
        self.workspace = workspace if workspace is not None else Workspace("llama.decode", dev)
        self.aux_stream = AuxStream("llama.rope_mask", dev)
        if seed is not None:
            self._init_random(seed)

    rope_cos: Tensor
    rope_sin: Tensor
    _ctx_range: Tensor
    _mask_keep: Tensor
    _mask_drop: Tensor

    # ------------------------------------------------------------------ construction

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        *,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> LlamaDecodeModel:
        """Seeded random weights made directly on ``device`` (no host copy of 1.2 B params)."""
        return cls(
            config, device=device, dtype=dtype, seed=seed, overlap=overlap, workspace=workspace
        )

    @torch.no_grad()
    def _init_random(self, seed: int) -> None:
        """std-0.02 matrices and unit norms: activations and logits stay non-degenerate."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for p in self.parameters():  # a tied head is listed once
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        config: LlamaConfig | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch: int | None = None,
        max_context: int | None = None,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> LlamaDecodeModel:
        """Load a local Hugging Face-format Llama directory (``config.json`` + ``*.safetensors``).

        Never downloads: ``path`` must be a directory on disk. ``config`` defaults to
        the one in ``config.json``; ``max_batch``/``max_context`` override the cache
        limits; ``dtype`` defaults to ``config.json``'s ``torch_dtype`` (else float32).
        Tensors stream file by file into the preallocated weights, so peak host memory
        is one tensor, not the checkpoint. Every shape is validated (errors name the
        tensor), every expected tensor must be present and unknown ones are refused.
        """
        config, dtype, tensors = weights.read_checkpoint(
            path, config, dtype=dtype, max_batch=max_batch, max_context=max_context
        )
        model = cls(
            config, device=device, dtype=dtype, seed=None, overlap=overlap, workspace=workspace
        )
        model.load_hf_weights(tensors)
        return model

    def hf_weight_views(self) -> dict[str, Tensor]:
        """Every weight under its Hugging Face name, as a view into the fused parameters."""
        return weights.hf_weight_views(self)

    def load_hf_weights(self, tensors: Mapping[str, Tensor] | Iterator[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model; see :func:`weights.load_hf_weights`."""
        weights.load_hf_weights(self, tensors)

    # ------------------------------------------------------------------ decode

    @property
    def scratch_slot(self) -> int:
        """The KV-cache slot padded rows use (``config.max_batch``)."""
        return self.config.max_batch

    def forward(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(token_ids, positions, slots)

    def decode_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Decode one token per row and return its logits ``[B, vocab]`` in the model dtype.

        **Rows are slots**: row ``b`` is the sequence in KV slot ``b``. It feeds
        ``token_ids[b]`` at ``positions[b]``, writes its key/value at
        ``cache[slots[b], :, positions[b]]`` and attends to ``cache[b, :, 0..positions[b]]``
        -- the batch's keys are the view ``cache[:B]``, never gathered. All inputs are
        ``[B]`` int64 on the model's device, ``B <= max_batch``.

        Caller guarantees: a live row ``b`` has ``slots[b] == b`` (an engine allocates
        slot = row, e.g. keeps its live sequences in slots ``0..n-1``) and
        ``positions[b] < max_context`` (out-of-range indices are a device-side assert,
        not a host check, because a check would synchronise). Padded rows use
        :meth:`pad_fill_values`: they write only the scratch slot and attend to position
        0 of their own row's slot, so they change neither a live cache nor a live row.
        Graph-capturable: no host sync, no value-dependent shapes or branches;
        per-step scratch (MLP intermediates, mask) comes from :attr:`workspace`, so the
        arena must already be large enough for ``B`` when this runs inside a capture.
        Under ``torch.compile`` the auxiliary branch runs inline, and the arena must
        already be warm (its growth is host code that Dynamo does not trace).
        """
        cfg = self.config
        batch = token_ids.shape[0]
        # Not while compiling: a comparison on the symbolic batch would add a guard.
        if not is_compiling() and batch > cfg.max_batch:
            raise ConfigError(
                f"decode_step: batch of {batch} rows, but the KV cache has max_batch="
                f"{cfg.max_batch} slots and decode rows are slots (row b uses slot b); "
                f"capture sizes must be <= {cfg.max_batch}, or build the model with "
                f"max_batch >= {batch}"
            )
        inter = cfg.intermediate_size
        dtype = self.dtype
        gate_up, act, mask = self.workspace.get(
            ((batch, 2 * inter), dtype),
            ((batch, inter), dtype),
            ((batch, 1, 1, cfg.max_context), dtype),
        )
        layers = [cast(LlamaDecoderLayer, m) for m in self.layers]
        h, x, cos, sin = self._prologue(token_ids, positions, mask, layers[0])

        q_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cudnn = cfg.decode_sdpa == "cudnn"
        qk_width = cfg.q_size + cfg.kv_size
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        for n, layer in enumerate(layers):
            if n:
                x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight)
            # RoPE once over q and k heads together (one set of kernels, not two).
            qk = apply_rope(qkv[:, :qk_width].view(batch, q_heads + kv_heads, hd), cos, sin)
            k = qk[:, q_heads:]
            v = qkv[:, qk_width:].view(batch, kv_heads, hd)
            write_kv(layer.k_cache, slots, positions, k)
            write_kv(layer.v_cache, slots, positions, v)
            out = attention(
                qk[:, :q_heads], layer.k_cache, layer.v_cache, positions, mask, cudnn=cudnn
            )
            h = self.row_parallel(h, out.reshape(batch, cfg.q_size), layer.o_weight)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            torch.mm(x, layer.gate_up_weight.t(), out=gate_up)
            torch.ops.aten.silu.out(gate, out=act)
            act.mul_(up)
            h = self.row_parallel(h, act, layer.down_weight)
        return F.linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)

    def row_parallel(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """``residual + x @ weight.T``: the o_proj and down_proj of every layer.

        The tensor-parallel hook: a shard holds a slice of ``weight``'s input columns,
        so :class:`~graphguard_ref.tp.TensorParallelLlama` overrides this to sum the
        partial products across ranks. Here the residual add rides in the GEMM epilogue
        (one ``addmm``, no separate add kernel).
        """
        return torch.addmm(residual, x, weight.t())

    def _positional(self, positions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE cos/sin rows ``[B, 1, hd]`` and the additive mask (into ``mask``) of a step.

        Depends only on ``positions`` and is shared by every layer, which is why it is
        the auxiliary-stream branch of :meth:`decode_step`.
        """
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        keep = self._ctx_range <= positions.view(-1, 1, 1, 1)
        torch.where(keep, self._mask_keep, self._mask_drop, out=mask)
        return cos, sin

    def mixed_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Run one engine step over ``T`` tokens of any mix of requests; logits ``[T, vocab]``.

        Token ``t`` feeds ``token_ids[t]`` at ``positions[t]`` of the sequence in KV slot
        ``slots[t]`` (all ``[T]`` int64 on the model's device). A batch is any
        concatenation of per-request runs of consecutive positions:

        * a prefill chunk: ``L`` tokens, positions ``p..p+L-1`` of one slot;
        * a decode: one token at position ``p`` (uniform decode: every request so);
        * a speculative verify: ``1 + k`` tokens (the last accepted token and ``k``
          drafts) at ``p..p+k``; row ``i``'s logits score the token after position
          ``p+i``, so one step verifies every draft.

        Every token writes its key/value at ``cache[slots[t], :, positions[t]]`` and attends
        to ``cache[slots[t], :, 0..positions[t]]``, so tokens of one request attend to the
        request's earlier tokens in the same batch (written in the same step) and to its
        cached past. Order of the requests in the batch does not matter.

        **Logits for every token** (``[T, vocab]``), not only each request's last: a
        verify step needs all ``1 + k`` rows, and per-token outputs keep every tensor of
        the step on the token dimension, which is what padding to a captured size and
        trimming back rely on. A caller that only samples the last token of a prefill
        chunk picks its rows (the extra head GEMM rows are the price of simplicity).

        Attention is :func:`mixed_attention` (custom op ``graphguard_ref::mixed_attention``,
        :data:`MIXED_ATTENTION_OP`), the split point of PIECEWISE graphs; everything else
        is plain out-of-place torch (no workspace arena, no auxiliary stream, no ``out=``)
        so ``torch.compile`` traces it whole with a dynamic token dimension. The step is
        also capturable as one FULL graph. Padded tokens take :meth:`pad_fill_values`
        (token 0, position 0, the scratch slot): they write only the scratch slot and
        attend only to it, so they cannot change a live sequence or a live row.

        Caller guarantees: live tokens have slots ``< max_batch``, positions
        ``< max_context``, distinct ``(slot, position)`` pairs, and each request's
        positions ``0..p-1`` already cached. Tokens are not slots here, so attention
        gathers each token's slot (:func:`mixed_attention`); :meth:`decode_step` is the
        gather-free one-token-per-row step (rows are slots) with the workspace arena and
        the auxiliary stream.
        """
        cfg = self.config
        num_tokens = token_ids.shape[0]
        q_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_width = cfg.q_size + cfg.kv_size
        inter = cfg.intermediate_size
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        keep = self._ctx_range <= positions.view(-1, 1, 1, 1)
        mask = torch.where(keep, self._mask_keep, self._mask_drop)
        h = F.embedding(token_ids, self.embed_tokens)
        for module in self.layers:
            layer = cast(LlamaDecoderLayer, module)
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight)
            qk = apply_rope(qkv[:, :qk_width].view(num_tokens, q_heads + kv_heads, hd), cos, sin)
            v = qkv[:, qk_width:].view(num_tokens, kv_heads, hd)
            out = mixed_attention(
                qk[:, :q_heads],
                qk[:, q_heads:],
                v,
                layer.k_cache,
                layer.v_cache,
                slots,
                positions,
                mask,
            )
            h = self.row_parallel(h, out.reshape(num_tokens, cfg.q_size), layer.o_weight)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up_weight)
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            h = self.row_parallel(h, act, layer.down_weight)
        return F.linear(rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)

    # ------------------------------------------------------------------ engine helpers

    @torch.no_grad()
    def _prologue(
        self, token_ids: Tensor, positions: Tensor, mask: Tensor, first: LlamaDecoderLayer
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Embedding + first RMSNorm (main stream) alongside RoPE cos/sin + mask (aux).

        Dynamo cannot trace stream switches or the phase monitor; a compiled step runs
        the branch inline (overlap is a CUDA-graph/eager feature of this model).
        """
        eps = self.config.rms_norm_eps
        if self.overlap and not is_compiling():
            with self.aux_stream.fork(positions, mask) as branch:
                cos, sin = self._positional(positions, mask)
                branch.keep(cos, sin)
                # Concurrently on the caller's stream (the capture stream while
                # capturing): embedding and the first RMSNorm, issued before the join.
                with branch.on_main():
                    h = F.embedding(token_ids, self.embed_tokens)
                    x = rms_norm(h, first.input_norm, eps)
        else:
            cos, sin = self._positional(positions, mask)
            h = F.embedding(token_ids, self.embed_tokens)
            x = rms_norm(h, first.input_norm, eps)
        return h, x, cos, sin

    def warm_kernels(self, sizes: Sequence[int]) -> None:
        """Run :meth:`decode_step` at the largest of ``sizes`` and at ``max_batch``.

        Meant as the runner's ``before_capture`` hook (``before_capture=[model.warm_kernels]``):
        it brings every lazily sized resource — the workspace arena above all — to its
        final size *before* any graph captures an address ("arena growth after capture").
        The arena's need grows with the batch, so the largest batch sizes it for all; warming
        ``config.max_batch`` too means eager fallback up to the cache's capacity never
        needs a bigger arena once it is locked. Per-shape kernel selection for the other
        sizes happens in the runner's own warmup forward before each capture, so running
        every size here would only pay each shape's first-run cost twice.
        Positions are spread over the whole context (realistic mask), and every row
        writes the scratch slot, so no live sequence's cache is touched (rows only read
        their own slots). A size above ``max_batch`` is refused here, before any capture,
        because decode rows are slots.
        """
        wanted = [int(s) for s in sizes]
        if any(s <= 0 for s in wanted):
            raise ConfigError(f"warm_kernels sizes must be positive, got {list(sizes)}")
        too_big = [s for s in wanted if s > self.config.max_batch]
        if too_big:
            raise ConfigError(
                f"warm_kernels: capture size(s) {too_big} exceed max_batch="
                f"{self.config.max_batch}; decode rows are KV slots (row b uses slot b), so "
                f"capture sizes <= {self.config.max_batch} or build the model with "
                f"max_batch >= {max(too_big)}"
            )
        batches = sorted({max(wanted, default=1), self.config.max_batch}, reverse=True)
        for batch in batches:
            positions = (
                torch.linspace(0, self.config.max_context - 1, batch, device=self.device)
                .round()
                .long()
            )
            tokens = torch.arange(batch, device=self.device) % self.config.vocab_size
            slots = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=self.device)
            self.decode_step(tokens, positions, slots)

    def example_inputs(
        self, batch: int, *, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Realistic ``(token_ids, positions, slots)`` for ``batch`` live rows.

        Rows are slots (``slots == arange(batch)``, what :meth:`decode_step` requires),
        positions anywhere in the context. Drawn on the CPU (``generator`` must be a
        CPU generator, for reproducibility across devices) and moved to the model's
        device.
        """
        cfg = self.config
        if not 0 < batch <= cfg.max_batch:
            raise ConfigError(
                f"example_inputs: batch must be in 1..max_batch={cfg.max_batch}, got {batch}"
            )
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=generator)
        positions = torch.randint(0, cfg.max_context, (batch,), generator=generator)
        slots = torch.arange(batch)
        return tokens.to(self.device), positions.to(self.device), slots.to(self.device)

    def pad_fill_values(self) -> tuple[int, int, int]:
        """Fill values of padded rows, in :meth:`decode_step` argument order.

        ``(token_id 0, position 0, scratch slot)``: a padded row writes only the
        scratch slot at position 0 and attends to a single position (its own row's slot
        in :meth:`decode_step`, the scratch slot in :meth:`mixed_step`), so it cannot
        corrupt a live sequence or change a live row, and never produces NaN. Pass as
        the runner's ``fill_values``.
        """
        return (0, 0, self.scratch_slot)

    def reset_cache(self) -> None:
        """Zero every KV slot in place (addresses kept, so captured graphs stay valid)."""
        for module in self.layers:
            layer = cast(LlamaDecoderLayer, module)
            layer.k_cache.zero_()
            layer.v_cache.zero_()


__all__ = ["LlamaDecodeModel", "LlamaDecoderLayer"]
