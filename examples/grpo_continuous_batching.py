"""GRPO-style RL on Hugging Face continuous batching, CUDA graphs on, weights synced into
the graphs after every optimizer step, each sync checked.

TRL's GRPO recipe on HF continuous batching turns CUDA graphs off (``use_cuda_graph:
False``) because nothing checks that a refit reaches graphs captured before it. Here the
rollout engine is graphguard's :class:`GraphedContinuousBatching` (a graph per step key,
captured on first use), and the loop is what an RL user runs:

1. **rollout**: ``prompts`` prompts x ``samples`` completions each (sampling, temperature
   1, no top-k/top-p: HF's log-probabilities are the model's own), prompt lengths and
   per-completion budgets varied, HF's per-token log-probabilities returned through the
   graphs (``ContinuousBatchingConfig(return_logprobs=True)``);
2. **reward**: a verifier with no network: the fraction of completion tokens whose parity
   is the parity of the prompt's token sum (chance 1/2, so every group has a spread);
3. **train**: GRPO's group-normalized advantages and PPO-clipped ratio against the
   rollout's log-probabilities, one optimizer step (torch's AdamW) on the policy, the
   trainer's own copy of the model;
4. **sync**: the policy's new weights into the rollout engine in place
   (``engine.weight_sync(policy)``: validated once, then a fused copy and a re-proof that
   no tensor the graphs read moved), then :func:`refit_verdict`: what the sync wrote, what
   it should have and did not, what moved, what the graphs read (provenance); the canary
   (``gg.Canary(every=...)``) shadows replays eagerly all along.

Printed per step: rollout tokens/s, sync milliseconds, the verdict, reward and loss.

Run it: on a CPU (the capture emulated by ``RecordingBackend``, a tiny Llama built from a
config; a few seconds a step) ``python examples/grpo_continuous_batching.py``; on a GPU
(a 0.5B Llama shape, bf16) ``python examples/grpo_continuous_batching.py --preset 0.5b``.
``bench/bench_rl_loop.py`` measures it; ``tests/test_rl_example.py`` runs it on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import graphguard as gg
from graphguard.integrations.hf_continuous import GraphedContinuousBatching

PRESETS: dict[str, dict[str, Any]] = {
    # A tiny Llama a CPU runs in seconds (vocab 101: ids 3..100 are "words").
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 101,
        "max_position_embeddings": 512,
    },
    # The tiny Llama at the 0.5B shape's depth (24 layers, tied embedding): the same 220
    # tensors to sync, for measuring the sync's host time on a CPU.
    "tiny24": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 24,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 101,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
    # A 0.5B Llama shape (Qwen2.5-0.5B's dimensions, Llama-3's vocabulary, tied embedding).
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


@dataclasses.dataclass
class LoopConfig:
    """One run of the loop (the command line's flags)."""

    preset: str = "tiny"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "float32"
    steps: int = 3
    prompts: int = 4
    samples: int = 4
    prompt_len: tuple[int, int] = (4, 12)
    new_tokens: tuple[int, int] = (3, 8)
    lr: float = 1e-3
    clip: float = 0.2
    train_seqs: int = 0
    """Sequences per optimizer step (0: all of the rollout's)."""
    do_sample: bool = True
    canary_every: int = 1
    provenance: bool = True
    proof_every: int = 1
    """Steps between full proofs (``check_weights()`` and the graphs' ``audit()``); every
    sync re-proves the addresses and the verdict counts versions at every step."""
    max_batch_tokens: int = 64
    num_blocks: int = 64
    max_graphs: int = 128
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


@dataclasses.dataclass
class Rollout:
    """One rollout: per completion its prompt, tokens, the engine's log-probabilities."""

    prompts: list[list[int]]
    budgets: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    seconds: float

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


# ------------------------------------------------------------------ models and engine


def build_model(cfg: LoopConfig, seed: int) -> Any:
    """A random-weight Llama of ``cfg.preset`` (no download), in ``cfg.dtype``."""
    config = transformers.LlamaConfig(
        **PRESETS[cfg.preset], bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(cfg.device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(cfg.torch_dtype)


def generation_config(cfg: LoopConfig) -> GenerationConfig:
    """Sampling at temperature 1 with no top-k/top-p, so HF's log-probabilities are the
    model's own (no logits processor runs); no EOS: each completion runs its budget."""
    return GenerationConfig(
        do_sample=cfg.do_sample,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=-1,
        pad_token_id=0,
        max_new_tokens=cfg.new_tokens[1],
    )


def batching_config(cfg: LoopConfig, **overrides: Any) -> ContinuousBatchingConfig:
    """The engine's batching: sized by ``cfg`` (HF sizes its cache from free memory when
    unset: on a CPU, GiBs of attention mask), log-probabilities returned, a fixed seed."""
    kw: dict[str, Any] = {
        "max_batch_tokens": cfg.max_batch_tokens,
        "num_blocks": cfg.num_blocks,
        "return_logprobs": True,
        "seed": cfg.seed,
    }
    kw.update(overrides)
    return ContinuousBatchingConfig(**kw)


def build_engine(model: Any, cfg: LoopConfig, backend: Any = None) -> GraphedContinuousBatching:
    """The rollout engine: every step graphed, the canary and provenance on."""
    if backend is None and cfg.device == "cpu":
        backend = gg.RecordingBackend()
    return GraphedContinuousBatching(
        model,
        backend=backend,
        max_graphs=cfg.max_graphs,
        canary=gg.Canary(every=cfg.canary_every),
        provenance=cfg.provenance,
        progress=False,
    )


# ------------------------------------------------------------------ the task


def tasks(cfg: LoopConfig, step: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """``cfg.prompts`` prompts (ids 3.., lengths in ``cfg.prompt_len``), each repeated
    ``cfg.samples`` times, and one generation budget per completion (in
    ``cfg.new_tokens``); seeded by ``step``."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    lo, hi = cfg.prompt_len
    prompts = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(lo, hi + 1, (cfg.prompts,), generator=g)
    ]
    repeated = [p for p in prompts for _ in range(cfg.samples)]
    budgets = torch.randint(cfg.new_tokens[0], cfg.new_tokens[1] + 1, (len(repeated),), generator=g)
    return repeated, budgets.tolist()


def reward(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """The verifier: the fraction of completion tokens whose parity is the parity of the
    prompt's token sum (no network, exact; replace with your task's)."""
    want = sum(prompt) % 2
    return sum(t % 2 == want for t in completion) / max(1, len(completion))


def advantages(rewards: Sequence[float], samples: int) -> torch.Tensor:
    """GRPO: each reward less its group's mean, over the group's standard deviation."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, samples)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, correction=0) + 1e-4)
    return a.flatten()


# ------------------------------------------------------------------ rollout and training


def rollout(engine: GraphedContinuousBatching, cfg: LoopConfig, step: int) -> Rollout:
    """One rollout through the graphed engine (synchronized and timed)."""
    prompts, budgets = tasks(cfg, step, engine.model.config.vocab_size)
    sync(cfg)
    t0 = time.perf_counter()
    out = engine.generate_batch(
        prompts,
        generation_config=generation_config(cfg),
        continuous_batching_config=batching_config(cfg),
        max_new_tokens=budgets,
    )
    sync(cfg)
    seconds = time.perf_counter() - t0
    results = list(out.values())
    return Rollout(
        prompts=prompts,
        budgets=budgets,
        tokens=[list(r.generated_tokens) for r in results],
        logprobs=[list(r.logprobs) for r in results],
        seconds=seconds,
    )


def sync(cfg: LoopConfig) -> None:
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def token_logprobs(
    model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities of each completion token under ``model`` (float32
    log-softmax of the logits at those positions only: the vocabulary-wide logits of whole
    sequences would not fit)."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    dev = next(model.parameters()).device
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    rows, cols, targets = [], [], []
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        for j in range(len(p), len(s)):
            rows.append(i)
            cols.append(j - 1)  # the position whose logits predict token j
            targets.append(s[j])
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    picked = hidden[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]
    logp = torch.log_softmax(model.lm_head(picked).float(), dim=-1)
    flat = logp.gather(1, torch.tensor(targets, device=dev)[:, None]).squeeze(1)
    return list(flat.split([len(c) for c in completions]))


def grpo_step(
    policy: Any, opt: torch.optim.Optimizer, ro: Rollout, cfg: LoopConfig
) -> dict[str, float]:
    """One optimizer step of GRPO's clipped objective on (a minibatch of) the rollout."""
    rewards = [reward(p, t) for p, t in zip(ro.prompts, ro.tokens)]
    adv = advantages(rewards, cfg.samples)
    keep = list(range(len(ro.tokens)))
    if cfg.train_seqs and cfg.train_seqs < len(keep):
        g = torch.Generator().manual_seed(cfg.seed + len(ro.tokens))
        keep = sorted(torch.randperm(len(keep), generator=g)[: cfg.train_seqs].tolist())
    policy.train()
    new = token_logprobs(policy, [ro.prompts[i] for i in keep], [ro.tokens[i] for i in keep])
    losses = []
    for lp, i in zip(new, keep):
        old = torch.tensor(ro.logprobs[i], device=lp.device)
        ratio = torch.exp(lp - old)
        a = float(adv[i])
        losses.append(-torch.min(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a).mean())
    loss = torch.stack(losses).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    policy.eval()
    return {"reward": statistics.fmean(rewards), "loss": float(loss.detach())}


# ------------------------------------------------------------------ what the refit check found


def weight_versions(model: Any) -> dict[str, int]:
    """Every parameter's and buffer's version counter (an in-place write bumps it)."""
    return Versions(model)()


class Versions:
    """:func:`weight_versions` of one model, its tensors listed once: a call reads the
    counters only (tens of microseconds for a 24-layer model). A tensor re-created after
    this was built keeps its old counter here, so it reads as not written: on the safe side."""

    def __init__(self, model: Any) -> None:
        named = list(model.named_parameters(remove_duplicate=False))
        named += list(model.named_buffers(remove_duplicate=False))
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]

    def __call__(self) -> dict[str, int]:
        return dict(zip(self.names, [t._version for t in self.tensors]))


def refit_verdict(
    update: Any,
    engine: GraphedContinuousBatching,
    before: dict[str, int] | None,
    expect: Iterable[str],
    *,
    full: bool = True,
    versions: Callable[[], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """What the refit check found. With graphguard's verdict (``update.refit``, issue 40:
    every tensor the graphs read classified moved / derived / written / not written) its
    classes are taken as they are, and each name must also have been written by this call
    by its version counter.

    - ``written`` / ``not_written``: of the names the refit had to change (``expect``),
      those written, and those that were not: stale values the graphs still read. A
      weight sync (``engine.weight_sync``) reads the counters of every name it copies
      around its own copy (``update.versions_checked``, ``versions_unchanged``): when they
      cover ``expect`` (a tuple: the cover is worked out once per pair), nothing else is
      read and ``before`` may be None; otherwise the counters now (``versions``: a
      :class:`Versions` of the engine's model, else :func:`weight_versions`) are compared
      with ``before``;
    - ``moved``: tensors re-created since capture (``update.moved``, the verdict's, and
      with ``full`` ``check_weights()``, which re-resolves every name against every
      graph's record);
    - with ``full`` and provenance on, from the graphs themselves (``audit()``): how many
      graphs, the parameters and buffers they read, ``read_not_written`` (a graph reads a
      name the refit left stale), ``stale`` (a read whose owner moved) and ``derived``
      (tensors no module lists, left stale by the refit).
    """
    judged = getattr(update, "refit", None)
    unwritten = {u.name for u in judged.not_written} if judged is not None else set()
    counted = getattr(update, "versions_checked", ())
    if counted and isinstance(expect, tuple) and _covered(counted, expect):
        # Every expected name's counter was read around this call's copy: not written if
        # it did not advance, or if graphguard's verdict says the copy does not write it.
        stale = unwritten.union(update.versions_unchanged)
        not_written = [n for n in expect if n in stale] if stale else []
        names, how = expect, "counted by the sync around its copy"
    else:
        if before is None:
            raise ValueError(
                "refit_verdict: before is None but the update did not count versions over "
                "every expected name (update_weights, or a name the sync does not copy): "
                "pass before=versions() read just before the refit"
            )
        now = versions() if versions is not None else weight_versions(engine.model)
        names = tuple(expect)
        wrote = set(judged.written) if judged is not None else set()
        written_set = {
            n for n in names if n in wrote or (n not in unwritten and now.get(n) != before.get(n))
        }
        not_written = [n for n in names if n not in written_set]
        how = "before and after the refit"
    moved = sorted({m.name for m in getattr(update, "moved", ())})
    if judged is not None:
        moved = sorted({*moved, *(m.name for m in judged.moved)})
    verdict: dict[str, Any] = {
        "copied": len(getattr(update, "copied", ())),
        "bytes": getattr(update, "bytes", 0),
        "written": len(names) - len(not_written),
        "not_written": not_written,
        "versions": how,
    }
    if full:
        moved = sorted({*moved, *(m.name for c in engine.check_weights() for m in c.moved)})
        audits = engine.audit()
        verdict["provenance"] = any(a.enabled for a in audits)
        reads = {
            r.name
            for a in audits
            for g in a.graphs
            for r in g.reads
            if r.kind in ("parameter", "buffer")
        }
        verdict["graphs"] = sum(len(a.graphs) for a in audits)
        verdict["weights_read"] = len(reads)
        verdict["read_not_written"] = sorted(reads & set(not_written))
        verdict["stale"] = sorted({name for a in audits for name, _, _ in a.stale})
        verdict["derived"] = (
            sorted(u.name for u in judged.stale_derived)
            if judged is not None
            else sorted({d for a in audits for d in a.derived})
        )
    verdict["moved"] = moved
    verdict["ok"] = not (not_written or moved or verdict.get("stale") or verdict.get("derived"))
    return verdict


_COVERS: dict[tuple[int, int], tuple[Any, Any, bool]] = {}


def _covered(counted: tuple[str, ...], expect: tuple[str, ...]) -> bool:
    """Whether every name of ``expect`` is in ``counted``; both are tuples (immutable), so
    the answer is kept per pair of objects (a loop passes the same two at every step)."""
    key = (id(counted), id(expect))
    hit = _COVERS.get(key)
    if hit is None or hit[0] is not counted or hit[1] is not expect:
        hit = (counted, expect, set(expect) <= set(counted))
        _COVERS[key] = hit
    return hit[2]


def stale_findings(verdict: dict[str, Any], divergences: int) -> int:
    """Stale reads found at one refit: the verdict's findings plus the canary's
    divergences since the last refit."""
    found = len(verdict["not_written"]) + len(verdict["moved"])
    found += len(verdict.get("stale", ())) + len(verdict.get("derived", ()))
    return found + divergences


def canary_divergences(engine: GraphedContinuousBatching) -> tuple[int, int]:
    """(checks, divergences) of the canary over every key so far."""
    stats = engine.canary_stats().values()
    return sum(s.checks for s in stats), sum(s.divergences for s in stats)


# ------------------------------------------------------------------ the loop


def run_loop(
    cfg: LoopConfig,
    *,
    backend: Any = None,
    on_rollout: Callable[[int, Rollout, Any], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log: Callable[[str], None] = print,
    models: tuple[Any, Any] | None = None,
    deadline: float | None = None,
    min_steps: int = 0,
) -> dict[str, Any]:
    """``cfg.steps`` steps of rollout, reward, train, sync, verdict. ``on_rollout(step,
    rollout, policy)`` is called after each rollout, before training (the policy's weights
    are then what the engine should hold); ``on_step(row)`` after each step. Stops early at
    ``deadline`` (``time.perf_counter()``), but not before ``min_steps`` steps. Returns the
    per-step rows, the engine (left open: ``close()`` it), the policy, the sync and the
    names each refit must write (a tuple)."""
    policy, rollout_model = models or (build_model(cfg, cfg.seed), build_model(cfg, cfg.seed))
    policy.eval()
    rollout_model.eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine = build_engine(rollout_model, cfg, backend)
    weight_sync = engine.weight_sync(policy)
    # What each refit must change: every trainable parameter (tied names share a storage).
    expect = tuple(n for n, _ in rollout_model.named_parameters(remove_duplicate=False))
    versions = Versions(rollout_model)
    rows: list[dict[str, Any]] = []
    seen = 0
    for step in range(cfg.steps):
        if deadline is not None and step >= min_steps and time.perf_counter() > deadline:
            log(f"stopping after {step} steps: out of time")
            break
        ro = rollout(engine, cfg, step)
        if on_rollout is not None:
            on_rollout(step, ro, policy)
        stats = grpo_step(policy, opt, ro, cfg)
        # Read for the fallback only (a sync that found a tensor re-created runs the full
        # update_weights, whose update counts no versions); the sync counts its own.
        before = versions()
        sync(cfg)
        t0 = time.perf_counter()
        update = weight_sync()
        verdict = refit_verdict(update, engine, before, expect, full=False, versions=versions)
        check_s = time.perf_counter() - t0
        proof_s = None
        if (step + 1) % max(1, cfg.proof_every) == 0 or step == cfg.steps - 1:
            t1 = time.perf_counter()
            verdict = refit_verdict(update, engine, before, expect, versions=versions)
            proof_s = time.perf_counter() - t1
        checks, diverged = canary_divergences(engine)
        row = {
            "step": step,
            "rollout_tokens": ro.generated,
            "rollout_s": ro.seconds,
            "tokens_per_s": ro.generated / ro.seconds,
            "sync_ms": update.seconds * 1e3,
            "sync_and_check_ms": check_s * 1e3,
            "proof_ms": None if proof_s is None else proof_s * 1e3,
            "bytes": update.bytes,
            "verdict": verdict,
            "canary_checks": checks,
            "canary_divergences": diverged,
            "stale_reads": stale_findings(verdict, diverged - seen),
            **stats,
        }
        seen = diverged
        rows.append(row)
        if on_step is not None:
            on_step(row)
        log(
            f"step {step}: rollout {ro.generated} tokens {row['tokens_per_s']:.0f} tok/s, "
            f"sync {row['sync_ms']:.2f} ms ({update.bytes / 2**20:.1f} MiB), verdict "
            f"{'ok' if verdict['ok'] else 'STALE'}: {verdict['written']} of {len(expect)} "
            f"written, {len(verdict['moved'])} moved"
            + (
                f", {verdict['graphs']} graphs read {verdict['weights_read']} weights"
                if "graphs" in verdict
                else ""
            )
            + f"; canary {diverged} of {checks} diverged; reward {stats['reward']:.3f}"
        )
    return {
        "rows": rows,
        "engine": engine,
        "policy": policy,
        "optimizer": opt,
        "sync": weight_sync,
        "expect": expect,
        "versions": versions,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--canary-every", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = LoopConfig(seed=args.seed)
    if args.preset == "0.5b":
        cfg = dataclasses.replace(
            cfg,
            preset="0.5b",
            dtype="bfloat16",
            steps=10,
            prompts=64,
            samples=8,
            prompt_len=(8, 32),
            new_tokens=(8, 24),
            lr=5e-4,
            train_seqs=64,
            canary_every=100,
            proof_every=10,
            max_batch_tokens=1024,
            num_blocks=512,
        )
    for flag in ("steps", "prompts", "samples", "canary_every"):
        if getattr(args, flag) is not None:
            cfg = dataclasses.replace(cfg, **{flag: getattr(args, flag)})
    out = run_loop(cfg)
    rows = out["rows"]
    out["engine"].close()
    stale = sum(r["stale_reads"] for r in rows)
    print(f"{len(rows)} refits, {stale} stale reads found")


if __name__ == "__main__":
    main()
