"""One rank's shard of the reference Llama model (Megatron tensor parallelism).

Contract: column-parallel q/k/v and gate/up (rank ``r`` keeps heads ``r*H/N..`` and KV
heads ``r*KV/N..``, so GQA groups stay whole), row-parallel o_proj and down_proj summed
by one ``torch.distributed.all_reduce`` each (:meth:`TensorParallelLlama.row_parallel`,
the only step code that differs from the base model); embedding, norms and ``lm_head``
replicated; the KV cache sharded by KV head. Every rank builds the same seeded full
weights and keeps its slice, so TP logits equal single-GPU logits up to the summation
order of the reductions (bitwise at ``N = 1``). The ``--tp`` demo lives in
:mod:`graphguard_ref.demo.tp`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from graphguard.errors import ConfigError
from graphguard.workspace import Workspace
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel, LlamaDecoderLayer


def shard_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The per-rank config: heads, KV heads and intermediate width divided by ``world_size``.

    Raises :class:`ConfigError` when they do not divide: KV heads are not replicated
    across ranks here (that would need a different cache layout).
    """
    if world_size < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {world_size}")
    bad = [
        f"{name}={value}"
        for name, value in (
            ("num_heads", config.num_heads),
            ("num_kv_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size),
        )
        if value % world_size
    ]
    if bad:
        raise ConfigError(
            f"tensor parallelism over {world_size} ranks needs num_heads, num_kv_heads and "
            f"intermediate_size divisible by {world_size}; not divisible: {', '.join(bad)}"
        )
    return replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


class TensorParallelLlama(LlamaDecodeModel):
    """One rank's shard of a Llama decode model; ``decode_step`` all-reduces across ranks.

    Args:
        config: the *full* model's config (kept as :attr:`full_config`; :attr:`config`
            is the per-rank one).
        rank, world_size: this rank's index in ``group`` and the group's size (default:
            read from ``group``; ``0`` and ``1`` without torch.distributed).
        group: the process group of the all-reduces (default: the world).
        device, dtype, overlap, workspace: as for :class:`LlamaDecodeModel`.

    Weights are left uninitialised; use :meth:`from_full` or :meth:`random_sharded`.
    With ``world_size == 1`` and no initialised process group the all-reduces are
    skipped (a plain single-GPU model); with a group they always run, even at size 1.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size(group) if initialized else 1
        if rank is None:
            rank = dist.get_rank(group) if initialized else 0
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
        if world_size > 1 and not initialized:
            raise ConfigError(
                f"a {world_size}-way tensor-parallel model needs torch.distributed "
                "initialized (dist.init_process_group) for its all-reduces"
            )
        if initialized and dist.get_world_size(group) != world_size:
            raise ConfigError(
                f"world_size={world_size}, but the process group has "
                f"{dist.get_world_size(group)} ranks"
            )
        super().__init__(
            shard_config(config, world_size),
            device=device,
            dtype=dtype,
            seed=None,
            overlap=overlap,
            workspace=workspace,
        )
        self.full_config = config
        self.tp_rank = rank
        self.tp_size = world_size
        self.group = group
        self._collective = initialized

    # ------------------------------------------------------------------ building

    @classmethod
    @torch.no_grad()
    def from_full(
        cls,
        full: LlamaDecodeModel,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> TensorParallelLlama:
        """This rank's shard of ``full`` (same device and dtype), weights copied.

        ``full`` may have a smaller ``max_batch``/``max_context`` than wanted; only its
        weights are read, the cache limits come from ``full.config``. Load a checkpoint
        with :meth:`LlamaDecodeModel.from_pretrained` and shard it with this.
        """
        model = cls(
            full.config,
            rank=rank,
            world_size=world_size,
            group=group,
            device=full.device,
            dtype=full.dtype,
            overlap=overlap,
            workspace=workspace,
        )
        model.load_shard(full)
        return model

    @classmethod
    def random_sharded(
        cls,
        config: LlamaConfig,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        workspace: Workspace | None = None,
    ) -> TensorParallelLlama:
        """The shard of ``LlamaDecodeModel.random(config, device, dtype, seed)``.

        Every rank generates the same full weights (same seed, same device type; the
        full model is built with a one-slot cache, so only its weights cost memory)
        and keeps its slice, so no rank needs another rank's memory.
        """
        full = LlamaDecodeModel.random(
            replace(config, max_batch=1, max_context=1), device=device, dtype=dtype, seed=seed
        )
        model = cls(
            config,
            rank=rank,
            world_size=world_size,
            group=group,
            device=full.device,
            dtype=dtype,
            overlap=overlap,
            workspace=workspace,
        )
        model.load_shard(full)
        del full
        return model

    @torch.no_grad()
    def load_shard(self, full: LlamaDecodeModel) -> None:
        """Copy this rank's slices of ``full``'s weights (shapes checked, errors name them)."""
        fc, lc = self.full_config, self.config
        for name in ("vocab_size", "hidden_size", "num_layers", "head_dim"):
            if getattr(full.config, name) != getattr(fc, name):
                raise ConfigError(
                    f"load_shard: full model has {name}={getattr(full.config, name)}, this "
                    f"shard was built for {getattr(fc, name)}"
                )
        if (full.config.num_heads, full.config.num_kv_heads, full.config.intermediate_size) != (
            fc.num_heads,
            fc.num_kv_heads,
            fc.intermediate_size,
        ):
            raise ConfigError("load_shard: the full model's head counts or width differ")
        r, hd = self.tp_rank, fc.head_dim
        q_rows = slice(r * lc.q_size, (r + 1) * lc.q_size)
        kv_rows = slice(r * lc.kv_size, (r + 1) * lc.kv_size)
        i_l = lc.intermediate_size
        i_rows = slice(r * i_l, (r + 1) * i_l)
        assert lc.q_size == lc.num_heads * hd
        self.embed_tokens.copy_(full.embed_tokens)
        self.norm.copy_(full.norm)
        if not fc.tie_word_embeddings:
            self.lm_head.copy_(full.lm_head)
        for mine_m, theirs_m in zip(self.layers, full.layers):
            mine = cast(LlamaDecoderLayer, mine_m)
            theirs = cast(LlamaDecoderLayer, theirs_m)
            q_full = theirs.qkv_weight[: fc.q_size]
            k_full = theirs.qkv_weight[fc.q_size : fc.q_size + fc.kv_size]
            v_full = theirs.qkv_weight[fc.q_size + fc.kv_size :]
            mine.qkv_weight.copy_(torch.cat((q_full[q_rows], k_full[kv_rows], v_full[kv_rows])))
            mine.o_weight.copy_(theirs.o_weight[:, q_rows])
            gate_full = theirs.gate_up_weight[: fc.intermediate_size]
            up_full = theirs.gate_up_weight[fc.intermediate_size :]
            mine.gate_up_weight.copy_(torch.cat((gate_full[i_rows], up_full[i_rows])))
            mine.down_weight.copy_(theirs.down_weight[:, i_rows])
            mine.input_norm.copy_(theirs.input_norm)
            mine.post_norm.copy_(theirs.post_norm)

    def hf_weight_views(self) -> dict[str, Tensor]:
        """Refused: a shard's weights are not the checkpoint's tensors.

        Load the full model with :meth:`LlamaDecodeModel.from_pretrained` and call
        :meth:`from_full`; exporting a shard under Hugging Face names would write slices
        as if they were whole matrices.
        """
        raise NotImplementedError(
            "TensorParallelLlama holds one rank's slices; load checkpoints with "
            "LlamaDecodeModel.from_pretrained(...) and shard with "
            "TensorParallelLlama.from_full(full, rank=..., world_size=...)"
        )

    def mixed_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Refused: the reference serving loop compiles ``mixed_step`` for PIECEWISE
        graphs, and compiling an in-place all-reduce is not something this shard has
        been shown to do correctly; it serves ``decode_step`` only."""
        raise NotImplementedError(
            "TensorParallelLlama serves decode_step only; mixed_step is single-GPU"
        )

    # ------------------------------------------------------------------ decode

    def row_parallel(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """``residual + sum over ranks of x_r @ weight_r.T``: the row-parallel projection.

        Rank 0 folds the residual into its GEMM epilogue (``addmm``), the other ranks
        contribute a plain ``mm``, so one all-reduce returns ``h + sum(partials)``
        without a separate add. The all-reduce is a ``torch.distributed`` collective,
        captured into the graph like any kernel on NCCL; every rank must run the step
        with the same batch (:class:`~graphguard.distributed.DistributedGraphRunner`
        checks that). Skipped when no process group is initialised (size 1).
        """
        here = self.tp_rank == 0
        out = torch.addmm(residual, x, weight.t()) if here else torch.mm(x, weight.t())
        if self._collective:
            dist.all_reduce(out, group=self.group)
        return out


__all__ = ["TensorParallelLlama", "shard_config"]
