"""HF continuous batching through graphguard on real CUDA graphs (issue 32).

- float32 greedy tokens equal HF's eager continuous batching on every request, Llama and
  Qwen2 (tiny seeded configs), through ``generate_batch`` and through the manager API with
  per-request generation lengths;
- an RL loop: 10 weight updates between ``generate_batch`` calls, each round equal to a
  fresh eager engine with those weights, on the same graphs (no recapture); and one with
  long prompts sharing a system prompt, where HF's prefix cache holds their pages across
  calls until ``update_weights`` drops it;
- the stale-key class: a Python int among the step's arguments that HF's key does not
  carry gets its own graph (equal to eager; HF's own graphs are run beside it and their
  agreement printed), and one outside every argument, changed after capture, is caught by
  the canary (``DivergenceError``);
- ``Lazy(budget=1)``: every key refused, every step eager, tokens still equal;
- a step that raises while its new key is captured (issue 38): the call fails, nothing is
  kept, and the next call on the same engine (and HF's own ``generate_batch`` on it) equals
  HF's eager engine, every replay shadowed by the canary; a token id past the vocabulary is
  refused before it reaches the device.

Run on the GPU machine (transformers 5.17):
``python -m pytest tests/gpu/test_hf_continuous_gpu.py -rA -s -p no:cacheprovider``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig
from transformers.generation.continuous_batching import input_outputs as hf_io
from transformers.generation.continuous_batching import model_runner as hf_runner

import graphguard as gg
from graphguard.errors import ConfigError, DivergenceError
from graphguard.integrations.hf_continuous import (
    GraphedContinuousBatching,
    graph_continuous_batching,
)
from tests import hf_families as F
from tests.hf_cb import cb_config, run_requests

DEV = "cuda"


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(3, 101, (k,), generator=g).tolist() for k in lens]


def gen(new: int = 24) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cbc(**kw: Any) -> Any:
    base = {
        "max_batch_tokens": 256,
        "num_blocks": 64,
        "q_padding_interval_size": 32,
        "kv_padding_interval_size": 256,
        "use_cuda_graph": False,
    }
    base.update(kw)
    return cb_config(page=16, **base)


def tokens(out: dict[str, Any]) -> list[list[int]]:
    return [list(r.generated_tokens) for r in out.values()]


def hf_eager(model: Any, ps: list[list[int]], new: int = 24, **kw: Any) -> list[list[int]]:
    out = model.generate_batch(
        ps, generation_config=gen(new), continuous_batching_config=cbc(**kw), progress_bar=False
    )
    return tokens(out)


def graphed_once_used_twice(st: dict[str, Any]) -> bool:
    """Every key used twice or more has a graph; a key used once ran its one step eagerly,
    as its warmup (a lazy size's first call), and has none."""
    return st["captured"] >= 1 and all(
        r["status"] == ("captured" if r["replays"] else "warmed") for r in st["per_key"]
    )


def run(cb: GraphedContinuousBatching, ps: list[list[int]], new: int = 24) -> list[list[int]]:
    return tokens(
        cb.generate_batch(ps, generation_config=gen(new), continuous_batching_config=cbc())
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float32_greedy_equals_hf_eager_continuous_batching(family, no_tf32):
    model = F.model(family, device=DEV)
    ps = prompts()
    want = hf_eager(model, ps)
    with GraphedContinuousBatching(model, progress=False) as cb:
        assert run(cb, ps) == want
        st = cb.stats()
        print(family, {k: v for k, v in st.items() if k not in ("runner", "per_key")})
        assert st["keys"] >= 2 and graphed_once_used_twice(st)
        assert st["graph_bytes"] > 0
        assert run(cb, ps) == want  # the same graphs again


def test_manager_api_with_per_request_lengths_equals_hf_eager(no_tf32):
    model = F.model("llama", seed=3, device=DEV)
    ps = prompts(16, seed=3)
    new = [1 + (7 * i) % 40 for i in range(len(ps))]
    kw = {"generation_config": gen(40), "continuous_batching_config": cbc()}
    want = run_requests(model, ps, new, **kw)["tokens"]
    with graph_continuous_batching(model, progress=False) as g:
        got = run_requests(model, ps, new, **kw)
        assert g.stats()["captured"] >= 1  # the keys met twice or more (a key's first is eager)
    assert got["tokens"] == want


def test_rl_loop_ten_weight_updates_equal_fresh_eager_engines(no_tf32):
    """Was an xfail (found 2026-12-01): the prompts here span full 16-token pages, HF's
    persistent engine kept their hashed blocks (old-weight KV) across the update and
    re-used them; update_weights now drops HF's prefix cache."""
    model = F.model("qwen2", seed=0, device=DEV)
    ps = prompts(8, seed=1)
    with GraphedContinuousBatching(model, progress=False) as cb:
        run(cb, ps)
        captured = 0
        for round_ in range(10):
            new = F.model("qwen2", seed=100 + round_, device=DEV).state_dict()
            cb.update_weights(new)
            fresh = F.model("qwen2", seed=0, device=DEV)
            fresh.load_state_dict(new)
            assert run(cb, ps) == hf_eager(fresh, ps), round_
            del fresh
            if round_ == 0:  # every key met twice now: a key's first step is eager
                captured = cb.stats()["captured"]
        assert cb.check_weights()[0]
        assert cb.stats()["captured"] == captured  # same keys, same graphs: no recapture


def long_prompts(n: int = 8, seed: int = 11, shared: int = 48) -> list[list[int]]:
    """Prompts of 80..199 tokens (5-12 full pages), the first ``shared`` common to all
    (a system prompt: HF's prefix cache shares its pages within a call)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 101, (shared,), generator=g).tolist()
    lens = torch.randint(80, 200, (n,), generator=g).tolist()
    return [head + torch.randint(3, 101, (k - shared,), generator=g).tolist() for k in lens]


def test_rl_loop_long_shared_prefix_prompts_never_reuse_old_weights_kv(no_tf32):
    """The same long prompts every round (max_position_embeddings 256: prompt + 24 new
    tokens fit): HF's prefix cache holds their pages after each call, update_weights drops
    every hash, and each round equals a fresh eager engine with its weights."""
    from graphguard.integrations import _hf_cb_prefix

    model = F.model("qwen2", seed=0, device=DEV)
    ps = long_prompts()
    kw = {"num_blocks": 256}

    def run_long(cb: GraphedContinuousBatching) -> list[list[int]]:
        return tokens(
            cb.generate_batch(ps, generation_config=gen(), continuous_batching_config=cbc(**kw))
        )

    with GraphedContinuousBatching(model, progress=False) as cb:
        assert run_long(cb) == hf_eager(F.model("qwen2", seed=0, device=DEV), ps, **kw)
        captured = 0
        for round_ in range(4):
            ((cache, _),) = cb._prefix_caches()
            kept = _hf_cb_prefix.hashed(cache)
            assert kept > 0  # the last call's pages
            new = F.model("qwen2", seed=200 + round_, device=DEV).state_dict()
            cb.update_weights(new)
            assert _hf_cb_prefix.hashed(cache) == 0
            fresh = F.model("qwen2", seed=0, device=DEV)
            fresh.load_state_dict(new)
            got, want = run_long(cb), hf_eager(fresh, ps, **kw)
            same = sum(a == b for a, b in zip(got, want))
            print(f"round {round_}: {kept} hashes dropped, {same}/{len(want)} requests equal")
            assert got == want, round_
            del fresh
            if round_ == 0:  # the first call's keys met twice now (the cache dropped)
                captured = cb.stats()["captured"]
        assert cb.stats()["captured"] == captured


def _plant(monkeypatch, source):  # type: ignore[no-untyped-def]
    original = hf_runner.ModelRunner._forward_process_and_sample

    def step(self, model, batch_data, carry, prev, out):  # type: ignore[no-untyped-def]
        shift = source(batch_data)  # a Python int: a CUDA graph bakes it
        inner = {k: v for k, v in batch_data.items() if k != "planted"}
        original(self, model, inner, carry, prev, out)
        out[0].copy_((out[0] + shift) % 101)

    monkeypatch.setattr(hf_runner.ModelRunner, "_forward_process_and_sample", step)


def test_python_value_hf_key_misses_gets_its_own_graph(monkeypatch, no_tf32):
    kwargs = hf_io.ContinuousBatchingIOs.get_model_kwargs

    def get_model_kwargs(self, use_padding=False):  # type: ignore[no-untyped-def]
        out = kwargs(self, use_padding=use_padding)
        out["planted"] = sum(self.total_seqlen_k.values()) % 2
        return out

    monkeypatch.setattr(hf_io.ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)
    _plant(monkeypatch, lambda bd: bd["planted"])
    model = F.model("llama", seed=4, device=DEV)
    ps = prompts(5, seed=4)
    want = hf_eager(model, ps)
    hf_graphs = hf_eager(model, ps, use_cuda_graph=True)
    same = sum(a == b for a, b in zip(hf_graphs, want))
    print(f"HF's own graphs with the planted value: {same}/{len(want)} requests equal eager")
    with GraphedContinuousBatching(model, progress=False) as cb:
        assert run(cb, ps) == want
        by_hf: dict[Any, int] = {}
        for row in cb.stats()["per_key"]:
            by_hf[row["hf_key"]] = by_hf.get(row["hf_key"], 0) + 1
        assert max(by_hf.values()) >= 2  # two graphs where HF keys one


def test_python_value_outside_every_key_is_caught_by_the_canary(monkeypatch, no_tf32):
    shift = {"value": 0}
    _plant(monkeypatch, lambda bd: shift["value"])
    model = F.model("llama", seed=5, device=DEV)
    ps = prompts(5, seed=5)
    canary = gg.Canary(every=1, on_divergence="raise")
    with GraphedContinuousBatching(model, progress=False, canary=canary) as cb:
        run(cb, ps)
        shift["value"] = 1
        with pytest.raises(DivergenceError):
            run(cb, ps)


def test_budget_of_one_byte_serves_every_step_eagerly(no_tf32):
    model = F.model("llama", seed=6, device=DEV)
    ps = prompts(6, seed=6)
    want = hf_eager(model, ps)
    with GraphedContinuousBatching(model, progress=False, lazy=gg.Lazy(budget=1)) as cb:
        assert run(cb, ps) == want
        st = cb.stats()
        assert st["captured"] == 0 and st["keys"] >= 1
        assert all(r["status"] != "captured" for r in st["per_key"])


def test_a_failed_key_leaves_nothing_and_the_next_call_equals_hf_eager(monkeypatch, no_tf32):
    """Issue 38 on CUDA graphs. HF's step raises (planted, a Python flag: a device check
    would sync inside the capture) on the first step of a call, in the lazy capture's
    warmup of its new key; before the fix the refused slot padded up to a slot with no key
    and the next call returned all-zero tokens. Greedy fp32 tiny Llama: no near ties."""
    fail = {"on": False}
    original = hf_runner.ModelRunner._forward_process_and_sample

    def step(self, model, batch_data, carry, prev, out):  # type: ignore[no-untyped-def]
        if fail["on"]:
            raise RuntimeError("planted step failure")
        original(self, model, batch_data, carry, prev, out)

    monkeypatch.setattr(hf_runner.ModelRunner, "_forward_process_and_sample", step)
    model = F.model("llama", seed=8, device=DEV)
    ps = prompts(8, seed=8)
    want = hf_eager(model, ps)
    canary = gg.Canary(every=1)
    with GraphedContinuousBatching(model, progress=False, canary=canary) as cb:
        with pytest.raises(ConfigError, match=r"inputs\[0\]\[2\] is 1000, outside"):
            run(cb, [[5, 6, 1000]])  # refused before the device sees it
        fail["on"] = True
        with pytest.raises(RuntimeError, match="planted step failure"):
            run(cb, [[5, 6, 7]])
        fail["on"] = False
        st = cb.stats()
        assert st["failed_keys"] >= 1 and st["keys"] == 0 and st["captured"] == 0
        assert run(cb, ps) == want
        st = cb.stats()
        assert st["keys"] >= 2 and graphed_once_used_twice(st)
        assert hf_eager(model, ps) == want  # HF's own generate_batch, on the kept engine
        checks = sum(s.checks for s in cb.canary_stats().values())
        diverged = sum(s.divergences for s in cb.canary_stats().values())
        print(f"after the failure: {st['keys']} keys, {checks} canary checks, {diverged} diverged")
        assert checks > 0 and diverged == 0


def test_rl_example_on_cuda_graphs_equals_hf_eager_and_the_canary_sees_a_recreated_weight(
    no_tf32,
):
    """The GRPO example (tiny Llama, fp32, greedy, 2 steps) on CUDA graphs: each rollout
    equals HF's eager engine with the policy's weights of that moment, every verdict is
    clean; then a parameter re-created outside any refit is seen by the canary (the graph
    reads the old storage, the eager shadow the new tensor) and named by check_weights."""
    import dataclasses

    from tests.test_rl_example import example

    ex = example()
    cfg = ex.LoopConfig(device=DEV, steps=2, prompts=2, samples=3, do_sample=False)

    def on_rollout(step: int, ro: Any, policy: Any) -> None:
        fresh = ex.build_model(cfg, cfg.seed + 1)
        fresh.load_state_dict(policy.state_dict())
        want = run_requests(
            fresh.eval(),
            ro.prompts,
            ro.budgets,
            generation_config=ex.generation_config(cfg),
            continuous_batching_config=ex.batching_config(cfg),
            warmup=False,
        )["tokens"]
        assert ro.tokens == want, step

    out = ex.run_loop(cfg, on_rollout=on_rollout, log=print)
    engine = out["engine"]
    try:
        assert all(r["verdict"]["ok"] and r["stale_reads"] == 0 for r in out["rows"])
        assert engine.stats()["captured"] >= 1
        every = dataclasses.replace(cfg, canary_every=1)
        engine.close()
        engine = ex.build_engine(engine.model, every)
        ex.rollout(engine, every, 50)
        attn = engine.model.model.layers[1].self_attn
        attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach() + 0.05)
        before = ex.canary_divergences(engine)[1]
        ex.rollout(engine, every, 50)
        diverged = ex.canary_divergences(engine)[1] - before
        moved = [m.name for c in engine.check_weights() for m in c.moved]
        print(f"re-created outside a refit: canary {diverged} divergences, moved {moved}")
        assert diverged > 0 and moved == ["model.layers.1.self_attn.o_proj.weight"]
    finally:
        engine.close()


@pytest.mark.parametrize("do_sample, dtype", [(True, "bfloat16"), (False, "bfloat16")])
def test_the_canary_sees_a_weight_re_created_outside_a_refit_when_sampling_in_bf16(
    do_sample, dtype
):
    """The bench's third plant (``bench_rl_loop.planted_part``) at the tiny shape: bf16,
    sampling as an RL rollout samples, the last layer's ``o_proj`` re-created with values
    0.01 away; the same prompts again, so the keys captured before replay: the canary
    (every replay) must see the graph read the old storage. The old parameter is kept
    alive: freed, its block goes back to the allocator and the stale graph reads whatever
    is put there next (on the H200 at 76963c7, NaN logits and torch's multinomial device
    assert, which ends the CUDA context and every test after it)."""
    from tests.test_rl_example import example

    ex = example()
    cfg = ex.LoopConfig(
        device=DEV,
        dtype=dtype,
        prompts=4,
        samples=2,
        new_tokens=(4, 8),
        do_sample=do_sample,
        canary_every=1,
    )
    model = ex.build_model(cfg, cfg.seed)
    engine = ex.build_engine(model, cfg)
    try:
        ex.rollout(engine, cfg, 20_000)
        replays = sum(r["replays"] for r in engine.stats()["per_key"])
        attn = model.model.layers[-1].self_attn
        old = attn.o_proj.weight  # held: the graph reads its values, not a freed block
        attn.o_proj.weight = torch.nn.Parameter(old.detach() + 0.01)
        checks0, div0 = ex.canary_divergences(engine)
        ex.rollout(engine, cfg, 20_000)
        checks, diverged = (a - b for a, b in zip(ex.canary_divergences(engine), (checks0, div0)))
        moved = [m.name for c in engine.check_weights() for m in c.moved]
        print(
            f"do_sample={do_sample} {dtype}: {replays} replays before the swap; after it "
            f"{checks} canary checks, {diverged} diverged; moved {moved}"
        )
        assert moved == [f"model.layers.{len(model.model.layers) - 1}.self_attn.o_proj.weight"]
        assert checks > 0 and diverged > 0
        del old
    finally:
        engine.close()
