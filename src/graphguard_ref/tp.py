"""Tensor parallelism for the reference Llama decode model, and ``graphguard demo --tp N``.

Why it exists: serving engines shard big models across GPUs and capture graphs that
contain the shards' all-reduces. graphguard must be shown capturing and replaying
exactly that, through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

The Megatron layout, on top of :class:`~graphguard.models.llama.LlamaDecodeModel`:

* **column-parallel** q/k/v and gate/up: rank ``r`` holds its slice of the output
  rows: query heads ``r*H/N .. (r+1)*H/N``, KV heads ``r*KV/N ..`` (so GQA groups stay
  whole on one rank), and its ``I/N`` slice of gate and of up;
* **row-parallel** o_proj and down_proj: rank ``r`` holds the matching input columns;
  each rank's partial product is summed by one ``torch.distributed.all_reduce`` per
  projection (two per layer). Rank 0 adds the residual in the GEMM epilogue
  (``addmm``) and the other ranks contribute a plain ``mm``, so the all-reduce returns
  ``h + sum(partials)`` without a separate add;
* embedding, norms and ``lm_head`` are **replicated** (every rank computes full logits;
  a vocab-parallel head would add an all-gather and save ``V*d/N`` weights, which the
  reference model does not need to show graphs with collectives);
* the KV cache is sharded by KV head: each rank caches only its heads.

A rank's model is a ``LlamaDecodeModel`` whose config has ``H/N`` heads, ``KV/N`` KV
heads and ``I/N`` intermediate width (so the workspace, the auxiliary stream, the
kernel warmup and the padding conventions are the single-GPU model's), with
:meth:`TensorParallelLlama.decode_step` adding the two all-reduces. Every rank builds the
same seeded *full* weights and keeps its shard (:meth:`TensorParallelLlama.random_sharded`),
so TP logits equal single-GPU logits up to the summation order of the row-parallel
reductions (bitwise at ``N = 1``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from graphguard.errors import ConfigError
from graphguard.models.llama import (
    LlamaConfig,
    LlamaDecodeModel,
    LlamaDecoderLayer,
    _apply_rope,
    _rms_norm,
    attention,
)
from graphguard.workspace import Workspace


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
        self._reduce = initialized

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
        """Refused: the inherited mixed (prefill) step has no all-reduces, so on a shard
        it would return one rank's partial sums as if they were logits."""
        raise NotImplementedError(
            "TensorParallelLlama implements decode_step only; mixed_step is single-GPU"
        )

    # ------------------------------------------------------------------ decode

    def _all_reduce(self, x: Tensor) -> None:
        if self._reduce:
            dist.all_reduce(x, group=self.group)

    def decode_step(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """:meth:`LlamaDecodeModel.decode_step` on this rank's heads, all-reduced.

        Same inputs and output (full ``[B, vocab]`` logits on every rank), same
        capturability: the two all-reduces per layer are ``torch.distributed``
        collectives, captured into the graph like any kernel on NCCL. Every rank must
        call it with the same batch (the :class:`~graphguard.distributed.DistributedGraphRunner`
        checks that).
        """
        cfg = self.config
        batch = token_ids.shape[0]
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
        qk_width = cfg.q_size + cfg.kv_size
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        residual_here = self.tp_rank == 0
        for n, layer in enumerate(layers):
            if n:
                x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight)
            qk = _apply_rope(qkv[:, :qk_width].view(batch, q_heads + kv_heads, hd), cos, sin)
            k = qk[:, q_heads:]
            v = qkv[:, qk_width:].view(batch, kv_heads, hd)
            layer.k_cache.index_put_((slots, positions), k)
            layer.v_cache.index_put_((slots, positions), v)
            out = attention(qk[:, :q_heads], layer.k_cache, layer.v_cache, slots, positions, mask)
            o_in = out.reshape(batch, cfg.q_size)
            # Row-parallel o_proj: rank 0 folds the residual in, the all-reduce sums.
            h = (
                torch.addmm(h, o_in, layer.o_weight.t())
                if residual_here
                else torch.mm(o_in, layer.o_weight.t())
            )
            self._all_reduce(h)
            x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            torch.mm(x, layer.gate_up_weight.t(), out=gate_up)
            torch.ops.aten.silu.out(gate, out=act)
            act.mul_(up)
            h = (
                torch.addmm(h, act, layer.down_weight.t())
                if residual_here
                else torch.mm(act, layer.down_weight.t())
            )
            self._all_reduce(h)
        return F.linear(_rms_norm(h, self.norm, cfg.rms_norm_eps), self.lm_head)


# --------------------------------------------------------------------------- demo


def free_port() -> int:
    """A free localhost TCP port for a rendezvous (racy in theory, fine for a demo/tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp_demo(
    tp: int,
    *,
    preset: str | None = None,
    max_batch: int = 256,
    max_context: int = 1024,
    sizes: Sequence[int] | None = None,
    steps: int = 400,
    phases: Sequence[int] | None = None,
    mode: str = "full",
    json_path: Path | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """``graphguard demo --tp N``: the decode demo with an N-way tensor-parallel model.

    Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` set) it runs as this process's
    rank. Otherwise it starts ``tp`` processes itself on this host (one GPU each; on a
    machine without CUDA, gloo on the CPU with the tiny preset, eagerly), so
    ``graphguard demo --tp 2`` works on a 2-GPU box without a launcher. Rank 0 prints
    and returns the result dict (other ranks return None); every rank checks its graph
    logits against its eager logits on every step.
    """
    kwargs: dict[str, Any] = {
        "preset": preset,
        "max_batch": max_batch,
        "max_context": max_context,
        "sizes": list(sizes) if sizes else None,
        "steps": steps,
        "phases": list(phases) if phases else None,
        "mode": mode,
        "json_path": str(json_path) if json_path else None,
    }
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ConfigError(f"--tp {tp}, but torchrun started {world} processes")
        return _tp_demo_rank(int(os.environ["RANK"]), tp, None, kwargs, out)
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        raise ConfigError(
            f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}"
        )
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_tp_demo_child, args=(rank, tp, port, kwargs, results))
        for rank in range(tp)
    ]
    for p in procs:
        p.start()
    result: dict[str, Any] | None = None
    failed = []
    for p in procs:
        p.join()
        if p.exitcode != 0:
            failed.append(p.exitcode)
    while not results.empty():
        kind, payload = results.get()
        if kind == "result":
            result = payload
        else:
            out(payload)
    if failed:
        raise RuntimeError(f"graphguard demo --tp {tp}: {len(failed)} rank(s) failed")
    if result is not None:
        for line in result.pop("lines", []):
            out(line)
    return result


def _tp_demo_child(
    rank: int, tp: int, port: int, kwargs: dict[str, Any], results: Any
) -> None:  # pragma: no cover - runs in a child process
    lines: list[str] = []
    try:
        res = _tp_demo_rank(rank, tp, port, kwargs, lines.append)
    except BaseException as exc:
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    if res is not None:
        res["lines"] = lines
        results.put(("result", res))


def _tp_demo_rank(
    rank: int,
    tp: int,
    port: int | None,
    kwargs: dict[str, Any],
    out: Callable[[str], None],
) -> dict[str, Any] | None:
    """One rank of the TP demo: init, build the shard, capture, check, time."""
    from graphguard.demo import DEFAULT_PHASES, Sequences, batch_schedule
    from graphguard.distributed import DistributedGraphRunner
    from graphguard.sizes import capture_sizes

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    init_kwargs: dict[str, Any] = {}
    if cuda:
        init_kwargs["device_id"] = device
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init,
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=120),
        **init_kwargs,
    )
    say = out if rank == 0 else (lambda _line: None)
    try:
        preset = kwargs["preset"] or ("llama-1b" if cuda else "tiny")
        mode = kwargs["mode"] if cuda else "none"
        if not cuda:
            say(
                "No CUDA device: running the tensor-parallel loop on gloo, eagerly "
                "(mode none), on the 'tiny' preset"
            )
        dtype = torch.bfloat16 if cuda else torch.float32
        cfg = LlamaConfig.preset(
            preset,
            max_batch=kwargs["max_batch"] if cuda else min(kwargs["max_batch"], 16),
            max_context=kwargs["max_context"] if cuda else min(kwargs["max_context"], 64),
        )
        model = TensorParallelLlama.random_sharded(cfg, device=device, dtype=dtype, seed=0)
        say(
            f"model: {preset} over {tp} ranks ({model.config.num_heads} heads, "
            f"{model.config.num_kv_heads} KV heads per rank), {dtype}, on {device.type}"
        )
        ladder = kwargs["sizes"] or capture_sizes(cfg.max_batch)
        runner = DistributedGraphRunner(
            model.decode_step,
            model.example_inputs(1),
            sizes=ladder,
            mode=mode,
            fill_values=model.pad_fill_values(),
            names=("token_ids", "positions", "slots"),
            before_capture=[model.warm_kernels],
            workspaces=[model.workspace],
            name=f"{preset}.tp{tp}.decode_step",
        )
        with torch.inference_mode():
            runner.capture()
            runner.log_report(say)
            phases = kwargs["phases"] or DEFAULT_PHASES
            schedule = batch_schedule(kwargs["steps"], phases, cfg.max_batch)
            gen = torch.Generator(device=device).manual_seed(1)
            first = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), device=device, generator=gen)
            model.reset_cache()
            seqs = Sequences(cfg.max_batch, cfg.max_context, device)
            tokens, worst, agree, total, equal_steps = first, 0.0, 0, 0, 0
            for b in schedule:
                pos, slots = seqs.step_inputs(b)
                tok = (
                    tokens[:b]
                    if tokens.shape[0] >= b
                    else torch.cat([tokens, first[tokens.shape[0] : b]])
                )
                g = runner(tok, pos, slots).float()
                e = model.decode_step(tok, pos, slots).float()
                worst = max(worst, float((g - e).abs().max()))
                equal_steps += int(torch.equal(g, e))
                agree += int((g.argmax(-1) == e.argmax(-1)).sum())
                total += b
                tokens = g.argmax(-1)
            check = {
                "rank": rank,
                "steps": len(schedule),
                "bitwise_equal_steps": equal_steps,
                "max_abs_logit_diff": worst,
                "argmax_agreement": agree / total,
            }
            checks: list[Any] = [None] * tp
            dist.all_gather_object(checks, check, group=runner.control_group)
            for c in checks:
                say(
                    f"rank {c['rank']}: graph vs eager over {c['steps']} steps: "
                    f"{c['bitwise_equal_steps']} bitwise equal, argmax agreement "
                    f"{100 * c['argmax_agreement']:.2f}%, max |diff| {c['max_abs_logit_diff']:.3g}"
                )
            per_batch: list[dict[str, float]] = []
            if cuda:
                times: dict[str, dict[int, list[float]]] = {}
                for label, fn in (("graphguard", runner), ("eager", model.decode_step)):
                    model.reset_cache()
                    times[label] = _time_steps(fn, schedule, cfg, device, first)
                say(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
                for b in sorted(times["eager"]):
                    e_ms = statistics.median(times["eager"][b])
                    g_ms = statistics.median(times["graphguard"][b])
                    per_batch.append({"batch": b, "eager_ms": e_ms, "graphguard_ms": g_ms})
                    say(f"{b:>6} {e_ms:>9.3f} {g_ms:>9.3f} {e_ms / g_ms:>7.2f}x")
        runner.release()
        result = {
            "tp": tp,
            "preset": preset,
            "mode": mode,
            "device": str(device.type),
            "checks": checks,
            "per_batch": per_batch,
        }
        if rank == 0 and kwargs["json_path"]:
            path = Path(kwargs["json_path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
            say(f"wrote {path}")
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _time_steps(
    fn: Callable[..., Tensor],
    schedule: Sequence[int],
    cfg: LlamaConfig,
    device: torch.device,
    first: Tensor,
) -> dict[int, list[float]]:
    """Per-step ms (CUDA events) over ``schedule``, grouped by batch size."""
    from graphguard.demo import Sequences

    seqs = Sequences(cfg.max_batch, cfg.max_context, device)
    marks: list[tuple[int, Any, Any]] = []
    tokens = first
    for b in schedule:
        pos, slots = seqs.step_inputs(b)
        tok = tokens[:b] if tokens.shape[0] >= b else first[:b]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        logits = fn(tok, pos, slots)
        end.record()
        tokens = logits.argmax(-1)
        marks.append((b, start, end))
    torch.cuda.synchronize()
    grouped: dict[int, list[float]] = {}
    for b, s, e in marks:
        grouped.setdefault(b, []).append(s.elapsed_time(e))
    return grouped


__all__ = ["TensorParallelLlama", "free_port", "run_tp_demo", "shard_config"]
