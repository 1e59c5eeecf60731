"""RL rollouts on continuous batching with graphs on and a refit every step (issue 42).

Runs ``examples/grpo_continuous_batching.py``'s loop (a 0.5B Llama shape, bf16, random
weights: hidden 896, 24 layers, vocab 128256, sdpa) for ``--steps`` steps of ``--prompts``
prompts x ``--samples`` completions (prompts of ``--prompt-len`` tokens, per-completion
budgets in ``--max-new``, sampling), a GRPO step and a weight sync into the graphed
engine after each, and measures:

- ``loop``: per step rollout tokens/s, the sync's milliseconds (copy and the re-proof of
  every address), the verdict (versions written / not written, moved; with the graphs'
  ``audit()`` every ``--proof-every`` steps), the canary's checks and divergences;
- ``copy``: in the same process, ``--copy-repeats`` syncs plus the example's verdict
  (graphguard's ``update.refit`` and the version counters the sync reads around its own
  copy: before the launch, again while the device copies) back to back against
  ``torch._foreach_copy_`` of the same tensors (the bare copy of the same bytes), each
  synchronized, medians: ``update_check_over_bare_copy``;
- ``logprobs``: the last rollout's per-token log-probabilities (HF's, through the graphs)
  against the same model run eagerly, teacher-forced on the same tokens, float32
  log-softmax of bf16 logits: max / p99 / mean |difference| (the rule: no token is
  excluded; a log-probability of a given token has no argmax to tie on, and its bf16 error
  is the logits' rounding, so the agreement is reported against ``--logprob-atol``);
- ``rollout``: tokens/s of the same rollout (prompts and budgets) on three engines in
  turn, ``--rounds`` rounds after one untimed warm-up rollout each, each synchronized,
  medians: graphguard (the loop's engine, weights as the loop left them), HF's
  continuous batching with graphs off (TRL's default) and HF's own graphs
  (``use_cuda_graph=True``), each HF engine persistent on a twin model with the same
  weights, all driven by the same per-request manager loop (``add_request(...,
  max_new_tokens=n)``). Interleaved because most of a rollout is HF's host-side scheduler,
  whose speed drifts between rollouts (``rollout_part``). HF's warmup (``--hf-warmup``,
  recorded under ``rollout.<engine>.warmup`` with the reason): ``zeroed`` (default) runs
  HF's own ``manager.warmup()`` unchanged after zeroing the paged cache HF allocated
  with ``torch.empty`` (5.17), because that warmup prefills over a past no request
  wrote, and NaN/inf bit patterns there end in torch's sampling device assert (the H200
  run of 0535d75; ``bench/hf_warmup_cache.py`` shows it on a CPU); ``none`` skips HF's
  warmup (HF then captures each size on first use, as graphguard does); ``hf`` runs it
  as HF does. HF's graphs, sampling and sizes are not touched in any mode;
- ``planted``: three stale refits on fresh engines (up to 4 prompts x 2 samples,
  the canary every replay): a loader that re-creates a parameter (``update_weights``
  refuses it, ``check_weights`` names it), a parameter re-created outside any refit (the
  canary's eager shadow reads the new one, the graph the old storage), a loader that
  skips one tensor in place (the verdict's version count names it; the canary cannot:
  graph and eager read the same stale storage).

The ``summary``: ``over_hf_graphs_off``, ``over_hf_graphs``, ``updates``, ``stale_reads``
(the loop's verdict findings plus canary divergences over every refit),
``update_check_over_bare_copy``, ``logprob_max_abs_diff``, and what caught each plant; it
is rewritten after every part (``parts_done``), so a part that ends the process leaves the
summary of the ones before it. The JSON names the commit (``GRAPHGUARD_COMMIT``), the GPU
and the date, and a PNG is drawn beside it.

Order and time. Loop, copy, logprobs, the engines' rollouts in turn, then planted.
``--time-limit`` (default 290 s) stops the loop ``--reserve`` (75 s) before it for the
parts after the loop, but never before ``--min-updates`` (100) refits: on the H200 at
0535d75 a loop step took 1.55 s (rollout 1.3 s, GRPO step, sync), so 104 steps take
about 165 s after 10 s of model building, and the parts after the loop about 70 s (five
rounds of three rollouts, HF graphs off about 3.3 s a rollout, HF's warmup and captures,
three small planted engines): expected about 4.5 minutes in all, under 5.

Batching as ``bench_hf_continuous.py`` (page 256, 512 blocks, ``--max-batch-tokens``
1024, HF's default padding intervals).

GPU: ``PYTHONPATH=src:ref/src python3 bench/bench_rl_loop.py --out
bench/results/rl-loop_NVIDIA-H200_<date>.json``. CPU smoke run of the plumbing (emulated
graphs, tiny model): ``--device cpu --preset tiny --steps 3 --prompts 4 --samples 4
--prompt-len 4,12 --max-new 3,8 --rounds 1 --copy-repeats 5 --max-batch-tokens 64
--num-blocks 64 --warmup-steps 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def load_example() -> Any:
    name = "grpo_continuous_batching"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ex = load_example()

from graphguard.errors import WeightsMovedError  # noqa: E402
from graphguard.integrations import _hf_cb_requests  # noqa: E402


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def cuda_sync(cfg: Any) -> None:
    ex.sync(cfg)


# ------------------------------------------------------------------ parts


def copy_part(out: dict[str, Any], cfg: Any, repeats: int) -> dict[str, Any]:
    """The sync and the example's verdict (graphguard's, plus the version counters the
    sync reads around its own copy) against the bare fused copy of the same tensors, back
    to back, each synchronized: medians."""
    weight_sync, engine, expect = out["sync"], out["engine"], out["expect"]
    dsts, srcs = weight_sync.pairs
    nbytes = sum(d.nbytes for d in dsts)
    bare: list[float] = []
    synced: list[float] = []
    sync_only: list[float] = []
    clean = 0
    for i in range(repeats + 2):
        cuda_sync(cfg)
        t0 = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        cuda_sync(cfg)
        t1 = time.perf_counter()
        cuda_sync(cfg)
        t2 = time.perf_counter()
        update = weight_sync()
        # before=None: the verdict must come from the counters the sync read around its
        # own copy (else refit_verdict raises), with graphguard's verdict (update.refit).
        verdict = ex.refit_verdict(update, engine, None, expect, full=False)
        t3 = time.perf_counter()
        if i >= 2:  # the first two of each: warm-up
            bare.append((t1 - t0) * 1e3)
            synced.append((t3 - t2) * 1e3)
            sync_only.append(update.seconds * 1e3)
        clean += bool(verdict["ok"])
    b, s = median(bare), median(synced)
    return {
        "bytes": nbytes,
        "tensors": len(dsts),
        "repeats": repeats,
        "verdicts_ok": clean,
        "bare_copy_ms": b,
        "sync_and_check_ms": s,
        "sync_ms": median(sync_only),
        "versions_counted": len(weight_sync.counted),
        "update_check_over_bare_copy": (s / b) if b and s else None,
        "bare_copy_gbps": nbytes / (b / 1e3) / 1e9 if b else None,
    }


def logprob_part(engine: Any, cfg: Any, ro: Any, seqs: int, atol: float) -> dict[str, Any]:
    dtype = cfg.dtype
    """HF's log-probabilities through the graphs against a teacher-forced eager forward
    of the same model on the same tokens."""
    n = min(seqs, len(ro.tokens))
    diffs: list[float] = []
    with torch.no_grad():
        for i in range(0, n, 16):
            idx = range(i, min(n, i + 16))
            eager = ex.token_logprobs(
                engine.model, [ro.prompts[j] for j in idx], [ro.tokens[j] for j in idx]
            )
            for j, want in zip(idx, eager):
                got = torch.tensor(ro.logprobs[j], device=want.device)
                diffs += (got - want).abs().tolist()
    diffs.sort()
    return {
        "sequences": n,
        "tokens": len(diffs),
        "max_abs_diff": diffs[-1] if diffs else None,
        "p99_abs_diff": diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))] if diffs else None,
        "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
        "atol": atol,
        "within_atol": sum(d <= atol for d in diffs) / max(1, len(diffs)),
        "rule": (
            "every sampled token compared (none excluded): a given token's log-probability "
            f"has no argmax to tie on; graphs (HF's padded continuous-batching step, {dtype}) "
            f"against a teacher-forced eager forward ({dtype}, unpadded), float32 log-softmax"
        ),
    }


HF_WARMUP_WHY = (
    "HF's warmup (ContinuousBatchingManager.warmup, run by generate_batch before the first "
    "request) steps a synthetic request through the model: on the varlen path one prefill "
    "of max_batch_tokens tokens over a past of num_blocks x block_size - max_batch_tokens "
    "tokens that no request ever wrote. transformers 5.17 allocates the paged cache with "
    "torch.empty (PagedAttentionCache.__init__: key_cache / value_cache, only the padding "
    "block zeroed), so that past is whatever the allocator handed back; bf16 garbage holds "
    "NaN and inf bit patterns, attention spreads them to the logits, and sampling "
    "(torch.multinomial) hits torch's device assert 'probability tensor contains either "
    "inf, nan or element < 0', which ends the CUDA context (H200, 0535d75). Real requests "
    "never read a slot before writing it, so only the warmup is affected; transformers "
    "5.2x allocates the cache with torch.zeros (one cache_tensor)"
)
HF_WARMUPS = {
    "zeroed": (
        "HF's own warmup, unchanged, after the paged cache was zeroed: the manager built as "
        "generate_batch builds it (same configs and workload hints), its batch processor "
        "created by HF (what manager.warmup() does first), every key/value cache tensor "
        "zeroed (what 5.2x allocates), then manager.warmup() (HF captures its graphs at its "
        "warmup sizes), then the manager kept on the model as HF's stop("
        "keep_for_next_session=True) keeps it; HF's graphs, sampling and sizes untouched"
    ),
    "none": (
        "HF's warmup skipped (warmup=False): HF captures each padded size on its first use, "
        "as graphguard's engine captures each key; the untimed first rollout takes them"
    ),
    "hf": "HF's warmup as HF runs it (on 5.17: the device assert, see why)",
}
ROLLOUT_STEP = 10_000
"""The comparison rollouts' prompts: a seed no loop step used, the same on every engine."""


def hf_prepare(model: Any, cfg: Any, step: int, warmup: str, **cb: Any) -> dict[str, Any]:
    """HF's persistent manager for :func:`hf_rollout`, built and warmed per ``warmup``
    (:data:`HF_WARMUPS`): what :func:`_hf_cb_requests.generate_each` then re-uses."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    info: dict[str, Any] = {"mode": warmup, "what": HF_WARMUPS[warmup]}
    if warmup != "zeroed":
        return info
    prompts, budgets = ex.tasks(cfg, step, model.config.vocab_size)
    manager = model.init_continuous_batching(
        generation_config=ex.generation_config(cfg),
        continuous_batching_config=ex.batching_config(cfg, **cb),
        workload_hints=WorkloadHints(  # as generate_each (and HF's generate_batch) hint
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=max(budgets),
            num_requests=len(prompts),
        ),
    )
    if manager.batch_processor is None:
        manager.batch_processor = manager._create_batch_processor()
    cache = manager.batch_processor.cache
    kv = [*getattr(cache, "key_cache", ()), *getattr(cache, "value_cache", ())]
    whole = getattr(cache, "cache_tensor", None)
    tensors = kv or ([whole] if isinstance(whole, torch.Tensor) else [])
    if not tensors:
        raise RuntimeError(
            f"bench_rl_loop: HF's paged cache ({type(cache).__name__}, transformers "
            f"{__import__('transformers').__version__}) has neither key_cache/value_cache "
            "nor cache_tensor to zero before HF's warmup; pass --hf-warmup none"
        )
    with torch.no_grad():
        for t in tensors:
            t.zero_()
    cuda_sync(cfg)
    t0 = time.perf_counter()
    manager.warmup()  # HF's own
    cuda_sync(cfg)
    info["warmup_s"] = time.perf_counter() - t0
    info["zeroed"] = {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors)}
    model._cached_continuous_batching_manager = manager  # as HF's stop(keep_for_next_session)
    return info


def hf_rollout(model: Any, cfg: Any, step: int, warmup: str, **cb: Any) -> tuple[int, float]:
    """HF's own engine (persistent), one request per completion with its budget: the
    same manager loop graphguard's per-request ``generate_batch`` runs."""
    prompts, budgets = ex.tasks(cfg, step, model.config.vocab_size)
    cuda_sync(cfg)
    t0 = time.perf_counter()
    out = _hf_cb_requests.generate_each(
        model,
        prompts,
        budgets,
        generation_config=ex.generation_config(cfg),
        continuous_batching_config=ex.batching_config(cfg, **cb),
        warmup=warmup == "hf",  # "zeroed": done by hf_prepare; "none": skipped
    )
    cuda_sync(cfg)
    seconds = time.perf_counter() - t0
    if len(out) != len(prompts) or any(r.error is not None for r in out.values()):
        raise RuntimeError(f"HF's engine returned {len(out)} of {len(prompts)} requests")
    return sum(len(r.generated_tokens) for r in out.values()), seconds


def twin(model: Any, cfg: Any) -> Any:
    """A second model with ``model``'s weights (HF keeps one persistent manager per model,
    so each engine of the interleaved rollouts gets its own)."""
    other = ex.build_model(cfg, cfg.seed)
    other.load_state_dict(model.state_dict())
    other.train(model.training)
    return other


def rollout_part(
    out: dict[str, Any],
    cfg: Any,
    rounds: int,
    log: Callable[[str], None],
    names: list[str],
    warmup: str,
) -> dict[str, dict[str, Any]]:
    """The engines' rollouts, interleaved: one untimed warm-up rollout each, then
    ``rounds`` rounds in which every engine runs the same rollout once, in turn;
    tokens/s median per engine. graphguard's engine is the loop's (weights as the loop
    left them); each HF engine (``names``: ``hf_graphs_off``, TRL's default, and
    ``hf_graphs``, HF's own graphs) is persistent on a twin of that model with the same
    weights, warmed per ``warmup`` (:data:`HF_WARMUPS`).

    Why interleaved: a rollout's time is mostly HF's host-side scheduler, the same code
    under every engine (H200, ``probe-rl-rollout``: 10-17 ms a step of
    ``prepare_next_batch`` from one rollout to the next, against 13.7 ms of forward
    step, the same under graphguard and HF's graphs). Engines timed one after another
    (0e15d86, two rollouts each) compared host drift, not engines: 0.91x there, 1.11x
    in the probe's run of the same engines. In turn, each round's drift is shared.

    An engine whose rollout raises is recorded (``error``) and leaves the rounds; the
    others go on (a device assert in HF's code ends the CUDA context, and every engine
    with it: those errors are recorded too)."""
    engine = out["engine"]
    model = engine.model
    res: dict[str, dict[str, Any]] = {"graphguard": {}}

    def graphed() -> tuple[int, float]:
        ro = ex.rollout(engine, cfg, ROLLOUT_STEP)
        return ro.generated, ro.seconds

    runs: dict[str, Callable[[], tuple[int, float]]] = {"graphguard": graphed}
    twins: list[Any] = []
    for name in names:
        graphs = name == "hf_graphs"
        res[name] = {}
        try:
            other = twin(model, cfg)
            twins.append(other)
            prep = hf_prepare(other, cfg, ROLLOUT_STEP, warmup, use_cuda_graph=graphs)
            res[name]["warmup"] = prep
            if warmup != "none":
                res[name]["warmup"]["why"] = HF_WARMUP_WHY

            def hf(other: Any = other, graphs: bool = graphs) -> tuple[int, float]:
                return hf_rollout(other, cfg, ROLLOUT_STEP, warmup, use_cuda_graph=graphs)

            runs[name] = hf
        except Exception as exc:
            res[name]["error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
    rates: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    try:
        for r in range(rounds + 1):  # round 0: the untimed warm-up rollouts
            for name, run in list(runs.items()):
                try:
                    n, seconds = run()
                except Exception as exc:
                    res[name]["error"] = f"{type(exc).__name__}: {exc}"
                    log(traceback.format_exc())
                    del runs[name]
                    continue
                what = "warm-up" if r == 0 else f"round {r}"
                log(f"{name}: {what}: {n} tokens in {seconds:.2f} s ({n / seconds:.0f} tok/s)")
                if r:
                    rates[name].append(n / seconds)
                    tokens[name] = n
    finally:
        engine.close()
        for other in twins:
            try:
                other.destroy_cached_continuous_batching_manager()
            except Exception as exc:  # a dead CUDA context: recorded
                res.setdefault("cleanup", {})["error"] = f"{type(exc).__name__}: {exc}"
        twins.clear()
        gc.collect()
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except Exception as exc:
                res.setdefault("cleanup", {})["error"] = f"{type(exc).__name__}: {exc}"
    for name, xs in rates.items():
        if xs:
            res[name].update(
                {"tokens_per_s": median(xs), "runs": xs, "tokens": tokens[name], "rounds": len(xs)}
            )
    return res


def planted_part(model: Any, policy: Any, cfg: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Three stale refits, each on a fresh engine of ``model`` (canary on every replay)."""
    small = dataclasses.replace(
        cfg, prompts=min(cfg.prompts, 4), samples=2, new_tokens=(4, 8), canary_every=1
    )
    expect = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    source = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for v in source.values():
            if v.is_floating_point():
                v.add_(0.01)  # new weights that differ from what the engine holds
    res: dict[str, Any] = {}

    def fresh() -> Any:
        engine = ex.build_engine(model, small)
        ex.rollout(engine, small, 20_000)  # the graphs, captured from the live weights
        return engine

    def canary_after(engine: Any) -> tuple[int, int]:
        """(checks, divergences) of the canary over a rollout of the same prompts as the
        capture's (so the keys captured then replay now; a rollout of other prompts meets
        new prefill keys, whose first steps run eagerly and whose captures read the live
        weights, and the canary may check nothing: 0e15d86 recorded 0 divergences and not
        the checks)."""
        before = ex.canary_divergences(engine)
        ex.rollout(engine, small, 20_000)
        after = ex.canary_divergences(engine)
        return int(after[0] - before[0]), int(after[1] - before[1])

    # 1. A skipped tensor: the rest written in place, one left with the old values.
    engine = fresh()
    last = len(model.model.layers) - 1
    skipped = f"model.layers.{last}.self_attn.v_proj.weight"

    def skipping() -> None:
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                if name != skipped and name in source:
                    t.copy_(source[name])

    before = ex.weight_versions(model)
    update = engine.update_weights(skipping, strict=False)  # strict: StaleWeightsError
    v = ex.refit_verdict(update, engine, before, expect)
    res["skipped_tensor"] = {
        "graphguard_refit_missing": [u.name for u in update.refit.missing] if update.refit else [],
        "verdict_not_written": v["not_written"],
        "verdict_read_not_written": v["read_not_written"],
        "caught_by_verdict": v["not_written"] == [skipped],
        "canary_checks_and_divergences": canary_after(engine),
        "why_canary_is_blind": "graph and eager both read the one stale storage",
    }
    engine.close()
    log(f"planted skipped tensor: {res['skipped_tensor']}")

    # 2. A loader that re-creates a parameter: refused by update_weights, named.
    engine = fresh()
    target = model.model.layers[0].mlp

    def recreating() -> None:
        name = "model.layers.0.mlp.gate_proj.weight"
        target.gate_proj.weight = torch.nn.Parameter(source[name].clone())

    refused = None
    try:
        engine.update_weights(recreating)
    except WeightsMovedError as exc:
        refused = exc.names
    v = ex.refit_verdict(None, engine, ex.weight_versions(model), expect)
    res["recreated_by_loader"] = {
        "update_weights_refused": list(refused or ()),
        "verdict_moved": v["moved"],
        "caught_by_check": bool(refused) and bool(v["moved"]),
        "canary_checks_and_divergences": canary_after(engine),
    }
    engine.close()
    log(f"planted re-created by a loader: {res['recreated_by_loader']}")

    # 3. A parameter re-created outside any refit call (the bug class of the frameworks
    # that keep graphs on): only the canary, or a check someone runs, sees it.
    engine = fresh()
    layer = model.model.layers[last].self_attn
    name = f"model.layers.{last}.self_attn.o_proj.weight"
    layer.o_proj.weight = torch.nn.Parameter(source[name].clone())
    checks, divergences = canary_after(engine)
    moved = [m.name for c in engine.check_weights() for m in c.moved]
    res["recreated_outside_refit"] = {
        "canary_checks": checks,
        "canary_divergences": divergences,
        "caught_by_canary": divergences > 0,
        "check_weights_moved": moved,
        "note": (
            "on a CPU the emulated replay re-runs the step on the live module, so the canary "
            "cannot see a re-created parameter there; CUDA graphs read the old storage"
        ),
    }
    engine.close()
    log(f"planted re-created outside a refit: {res['recreated_outside_refit']}")
    return res


# ------------------------------------------------------------------ the run


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["loop"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["tokens_per_s"] for r in rows], label="graphguard, in the loop")
    colors = {"graphguard": "tab:blue", "hf_graphs": "tab:green", "hf_graphs_off": "tab:red"}
    for name, color in colors.items():
        tps = result.get("rollout", {}).get(name, {}).get("tokens_per_s")
        if tps:
            axes[0].axhline(tps, linestyle="--", color=color, label=f"{name} (in turn)")
    axes[0].set_xlabel("RL step")
    axes[0].set_ylabel("rollout tokens/s")
    axes[0].legend(fontsize=7)
    axes[1].plot(steps, [r["sync_and_check_ms"] for r in rows], label="sync + check")
    bare = result.get("copy", {}).get("bare_copy_ms")
    if bare:
        axes[1].axhline(bare, linestyle="--", color="k", label="bare copy, same bytes")
    axes[1].set_xlabel("RL step")
    axes[1].set_ylabel("ms")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [r["reward"] for r in rows])
    axes[2].set_xlabel("RL step")
    axes[2].set_ylabel("mean reward (parity task)")
    s = result.get("summary", {})
    fig.suptitle(
        f"RL loop {result['device']} {result['date']}: {s.get('updates')} refits, "
        f"{s.get('stale_reads')} stale reads; x{s.get('over_hf_graphs_off')} HF graphs off, "
        f"x{s.get('over_hf_graphs')} HF graphs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(ex.PRESETS), default="0.5b")
    ap.add_argument("--steps", type=int, default=104)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=pair, default=(8, 32))
    ap.add_argument("--max-new", type=pair, default=(8, 24))
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--canary-every", type=int, default=100)
    ap.add_argument("--proof-every", type=int, default=10)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-graphs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copy-repeats", type=int, default=50)
    ap.add_argument("--logprob-seqs", type=int, default=64)
    ap.add_argument("--logprob-atol", type=float, default=0.1)
    ap.add_argument(
        "--time-limit",
        type=float,
        default=290.0,
        help="seconds for the whole run; the loop stops --reserve seconds before it, but "
        "not before --min-updates steps",
    )
    ap.add_argument("--reserve", type=float, default=75.0)
    ap.add_argument("--min-updates", type=int, default=100)
    ap.add_argument(
        "--hf-warmup",
        choices=sorted(HF_WARMUPS),
        default="zeroed",
        help="how HF's engines are warmed up before their timed rollouts (HF_WARMUPS)",
    )
    ap.add_argument(
        "--skip", default="", help="parts to leave out: hf_graphs_off,hf_graphs,planted"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    t_start = time.perf_counter()
    cuda = args.device.startswith("cuda")
    cfg = ex.LoopConfig(
        preset=args.preset,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        steps=args.steps,
        prompts=args.prompts,
        samples=args.samples,
        prompt_len=args.prompt_len,
        new_tokens=args.max_new,
        lr=args.lr,
        train_seqs=args.train_seqs,
        canary_every=args.canary_every,
        proof_every=args.proof_every,
        max_batch_tokens=args.max_batch_tokens,
        num_blocks=args.num_blocks,
        max_graphs=args.max_graphs,
        seed=args.seed,
    )
    result: dict[str, Any] = {
        "bench": "rl-loop",
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items()},
        "bench_args": {k: str(v) for k, v in vars(args).items()},
        "model": ex.PRESETS[args.preset],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        args.out.write_text(json.dumps(result, indent=1, default=str))

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {line}", flush=True)

    rows: list[dict[str, Any]] = []
    result["loop"] = {"rows": rows}

    def on_step(row: dict[str, Any]) -> None:
        rows.append(row)
        if len(rows) % 10 == 0:
            save()

    # The loop's share of the time limit leaves --reserve seconds for the parts after it,
    # but the loop runs --min-updates steps whatever the clock says (the count).
    deadline = t_start + args.time_limit - args.reserve
    log(f"building the {args.preset} models on {args.device}")
    models = (ex.build_model(cfg, cfg.seed), ex.build_model(cfg, cfg.seed))
    params = sum(p.numel() for p in models[0].parameters())
    result["params"] = params
    log(f"{params / 1e6:.0f}M parameters each (policy, rollout); loop of {cfg.steps} steps")
    out = ex.run_loop(
        cfg,
        on_step=on_step,
        log=log,
        models=models,
        deadline=deadline,
        min_steps=min(args.min_updates, cfg.steps),
    )
    steady = rows[args.warmup_steps :] or rows
    result["loop"].update(
        {
            "steps_run": len(rows),
            "stopped_early": len(rows) < cfg.steps,
            "seconds": time.perf_counter() - t_start,
            "tokens_per_s_median": median([r["tokens_per_s"] for r in steady]),
            "sync_ms_median": median([r["sync_ms"] for r in steady]),
            "sync_and_check_ms_median": median([r["sync_and_check_ms"] for r in steady]),
            "proof_ms_median": median([r["proof_ms"] for r in steady if r["proof_ms"]]),
            "stale_reads": sum(r["stale_reads"] for r in rows),
            "canary_checks": rows[-1]["canary_checks"] if rows else 0,
            "canary_divergences": rows[-1]["canary_divergences"] if rows else 0,
            "proofs": sum(r["proof_ms"] is not None for r in rows),
            "verdicts_ok": sum(r["verdict"]["ok"] for r in rows),
            "sync_rebuilt": out["sync"].rebuilt,
            "engine": {
                k: v for k, v in out["engine"].stats().items() if k not in ("runner", "per_key")
            },
        }
    )
    rollouts: dict[str, Any] = {}
    result["rollout"] = rollouts

    def summarize() -> None:
        """The summary from what has run so far (rewritten after every part: a part that
        kills the process leaves the summary of the ones before it)."""
        planted = result.get("planted", {})

        def ratio(name: str) -> float | None:
            mine = rollouts.get("graphguard", {}).get("tokens_per_s")
            theirs = rollouts.get(name, {}).get("tokens_per_s")
            return round(mine / theirs, 3) if mine and theirs else None

        result["summary"] = {
            "over_hf_graphs_off": ratio("hf_graphs_off"),
            "over_hf_graphs": ratio("hf_graphs"),
            "hf_graphs_warmup": rollouts.get("hf_graphs", {}).get("warmup", {}).get("mode"),
            "hf_graphs_error": rollouts.get("hf_graphs", {}).get("error"),
            "updates": len(rows),
            "stale_reads": result["loop"]["stale_reads"],
            "update_check_over_bare_copy": result.get("copy", {}).get(
                "update_check_over_bare_copy"
            ),
            "logprob_max_abs_diff": result.get("logprobs", {}).get("max_abs_diff"),
            "logprob_p99_abs_diff": result.get("logprobs", {}).get("p99_abs_diff"),
            "logprob_rule": result.get("logprobs", {}).get("rule"),
            "loop_tokens_per_s_median": result["loop"]["tokens_per_s_median"],
            "planted_caught": {
                "skipped_tensor": planted.get("skipped_tensor", {}).get("caught_by_verdict"),
                "recreated_by_loader": planted.get("recreated_by_loader", {}).get(
                    "caught_by_check"
                ),
                "recreated_outside_refit": planted.get("recreated_outside_refit", {}).get(
                    "caught_by_canary"
                ),
            },
            "parts_done": [k for k in ("copy", "logprobs", "planted") if k in result]
            + [f"rollout.{k}" for k in rollouts],
            "targets": {
                "over_hf_graphs_off": ">= 1.3",
                "over_hf_graphs": ">= 0.95",
                "updates": ">= 100",
                "stale_reads": "0",
                "update_check_over_bare_copy": "<= 1.2",
            },
        }
        save()

    summarize()
    log(
        f"loop: {json.dumps({k: v for k, v in result['loop'].items() if k != 'rows'}, default=str)}"
    )
    log(f"updates: {len(rows)} refits (target >= 100)")

    result["copy"] = copy_part(out, cfg, args.copy_repeats)
    summarize()
    log(f"copy: {json.dumps(result['copy'])}")

    ro = ex.rollout(out["engine"], cfg, 30_000)
    try:
        result["logprobs"] = logprob_part(
            out["engine"], cfg, ro, args.logprob_seqs, args.logprob_atol
        )
    except Exception as exc:
        result["logprobs"] = {"error": f"{type(exc).__name__}: {exc}"}
        log(traceback.format_exc())
    summarize()
    log(f"logprobs: {json.dumps(result['logprobs'])}")

    policy, model = out["policy"], out["engine"].model
    del out["optimizer"]
    # The engines' rollouts in turn (see rollout_part); HF's graphs need CUDA.
    names = [n for n in ["hf_graphs_off"] + (["hf_graphs"] if cuda else []) if n not in skip]
    rollouts.update(rollout_part(out, cfg, args.rounds, log, names, args.hf_warmup))
    summarize()

    if "planted" not in skip:
        try:
            result["planted"] = planted_part(model, policy, cfg, log)
        except Exception as exc:
            result["planted"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(traceback.format_exc())
        summarize()

    save()
    log(f"summary: {json.dumps(result['summary'], default=str)}")
    try:
        plot(result, args.out.with_suffix(".png"))
    except Exception as exc:  # the JSON is the result; the plot is a view of it
        log(f"plot failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
