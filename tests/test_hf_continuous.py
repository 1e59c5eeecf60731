"""HF continuous batching through graphguard on CPU (RecordingBackend): greedy tokens equal
HF's eager engine on two families, a graph per step key captured lazily and reused across
calls, a Python value HF's key misses gets its own graph, one outside every key is caught
by the canary, an RL loop of weight updates equals fresh eager engines (with long,
repeated prompts too: HF's prefix cache is dropped on each update), and every unsupported
setting is refused by name."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig
from transformers.generation.continuous_batching import model_runner as hf_runner

import graphguard as gg
from graphguard import phase
from graphguard.errors import ConfigError, DivergenceError, UnsupportedModelError
from graphguard.integrations import _hf_cb_install, _hf_cb_keys, _hf_cb_prefix, hf_continuous
from graphguard.integrations.hf_continuous import (
    GraphedContinuousBatching,
    graph_continuous_batching,
)
from tests import hf_families as F
from tests.hf_cb import cb_config, run_requests

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21] * 13, [33, 34]]


def gen(new: int = 6) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cbc(**kw: Any) -> Any:
    base = {
        "max_batch_tokens": 64,
        "num_blocks": 32,
        "q_padding_interval_size": 16,
        "kv_padding_interval_size": 64,
    }
    base.update(kw)
    return cb_config(page=16, **base)


def tokens(out: dict[str, Any]) -> list[list[int]]:
    """Generated tokens in request order (request ids continue across calls)."""
    return [list(r.generated_tokens) for r in out.values()]


def hf_eager(model: Any, prompts=PROMPTS, new: int = 6) -> list[list[int]]:
    out = model.generate_batch(
        prompts, generation_config=gen(new), continuous_batching_config=cbc(), progress_bar=False
    )
    return tokens(out)


def graphed(model: Any, backend: Any = None, **kw: Any) -> GraphedContinuousBatching:
    return GraphedContinuousBatching(
        model, backend=backend or gg.RecordingBackend(), progress=False, **kw
    )


def graphed_once_used_twice(st: dict[str, Any]) -> bool:
    """Every key used twice or more has a graph; a key used once ran its one step eagerly,
    as its warmup (a lazy size's first call), and has none."""
    return st["captured"] >= 1 and all(
        r["status"] == ("captured" if r["replays"] else "warmed") for r in st["per_key"]
    )


def run(cb: GraphedContinuousBatching, prompts=PROMPTS, new: int = 6) -> list[list[int]]:
    return tokens(
        cb.generate_batch(prompts, generation_config=gen(new), continuous_batching_config=cbc())
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_hf_eager_continuous_batching(family):
    model = F.model(family)
    want = hf_eager(model)
    cb = graphed(model)
    try:
        assert run(cb) == want
        st = cb.stats()
        assert st["keys"] >= 2 and graphed_once_used_twice(st)
        # The decode key's steps after its first (its warmup) replay.
        assert sum(r["replays"] for r in st["per_key"]) >= len(PROMPTS) - 1
    finally:
        cb.close()


def test_keys_are_captured_lazily_once_and_reused_across_calls():
    model = F.model("llama", seed=2)
    backend = gg.RecordingBackend()
    cb = graphed(model, backend)
    try:
        first = run(cb)
        captures = backend.names().count("capture_end")
        st = cb.stats()
        assert captures == st["captured"]  # one capture per key, at its second use
        for row in st["per_key"]:
            # HF's key is recorded beside the full one; q is padded to HF's interval.
            assert row["hf_key"] and row["hf_key"][0] % 16 == 0
        assert run(cb) == first  # the same engine, graphs and results
        captures = backend.names().count("capture_end")
        assert captures == cb.stats()["captured"] == cb.stats()["keys"]  # each key once
        assert run(cb) == first
        assert backend.names().count("capture_end") == captures  # nothing recaptured
        assert cb.stats()["steps"] > st["steps"]
        assert cb.check_weights()[0]
    finally:
        cb.close()


def test_eager_mode_and_table_full_run_hf_step_eagerly():
    model = F.model("llama", seed=1)
    ps = PROMPTS + long_prompts(2)  # four step keys
    want = eager_long(model, ps)
    cb = graphed(model, max_graphs=2)
    try:
        assert run_long(cb, ps) == want
        st = cb.stats()
        assert st["keys"] == 2 and st["eager_table_full"] >= 1
    finally:
        cb.close()


# ---------------------------------------------------------------- baked Python values


class BakingBackend(gg.RecordingBackend):
    """RecordingBackend whose replays see what a step baked at capture, as a CUDA graph
    does: a step reads ``backend.baked()`` to get its capture-time value on a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.label: Any = None
        self.replaying = False
        self.values: dict[Any, Any] = {}

    def capture(self, body, **kw):  # type: ignore[no-untyped-def]
        label = kw.get("label")
        first = [True]

        def recorded() -> Any:
            self.label = label
            if first[0]:
                first[0] = False
                return body()
            self.replaying = True
            try:
                return body()
            finally:
                self.replaying = False

        return super().capture(recorded, **kw)

    def bake(self, live: Any) -> Any:
        """The value a graph would see: the live one, frozen at capture."""
        if phase.is_capturing():
            self.values[self.label] = live
        return self.values[self.label] if self.replaying else live


@contextlib.contextmanager
def planted(monkeypatch, source):  # type: ignore[no-untyped-def]
    """HF's step shifts every new token by a Python int that ``source(batch_data)`` gives
    (and ``bake`` freezes when a graph replays), mod the vocabulary."""
    original = hf_runner.ModelRunner._forward_process_and_sample
    bake = [lambda v: v]

    def step(self, model, batch_data, carry, prev, out):  # type: ignore[no-untyped-def]
        shift = bake[0](source(batch_data))
        inner = {k: v for k, v in batch_data.items() if k != "planted"}  # not for the model
        original(self, model, inner, carry, prev, out)
        out[0].copy_((out[0] + shift) % 101)

    monkeypatch.setattr(hf_runner.ModelRunner, "_forward_process_and_sample", step)
    yield bake


def test_a_python_value_hf_key_misses_gets_its_own_graph(monkeypatch):
    """A step argument ``planted`` (the batch's true KV length mod 2, a Python int) differs
    between steps that HF keys alike (the same padded q and kv): HF's graph would replay
    the capture's value; graphguard keys it and stays exact."""
    from transformers.generation.continuous_batching import input_outputs as hf_io

    kwargs = hf_io.ContinuousBatchingIOs.get_model_kwargs

    def get_model_kwargs(self, use_padding=False):  # type: ignore[no-untyped-def]
        out = kwargs(self, use_padding=use_padding)
        out["planted"] = sum(self.total_seqlen_k.values()) % 2
        return out

    monkeypatch.setattr(hf_io.ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)
    model = F.model("llama", seed=4)
    with planted(monkeypatch, lambda bd: bd["planted"]) as bake:
        want = hf_eager(model)
        backend = BakingBackend()
        bake[0] = backend.bake
        cb = graphed(model, backend)
        try:
            assert run(cb) == want
            rows = cb.stats()["per_key"]
            by_hf: dict[Any, set[Any]] = {}
            for r in rows:
                by_hf.setdefault(r["hf_key"], set()).add(r["key"])
            # Some HF key covers steps with both values: two graphs where HF has one.
            assert any(len(v) == 2 for v in by_hf.values()), rows
        finally:
            cb.close()


def test_a_python_value_outside_every_key_is_caught_by_the_canary(monkeypatch):
    """A module-level int the step reads (no argument carries it) changes after capture:
    the canary's eager shadow sees the live value, the replay the baked one."""
    shift = {"value": 0}
    model = F.model("llama", seed=5)
    with planted(monkeypatch, lambda bd: shift["value"]) as bake:
        backend = BakingBackend()
        bake[0] = backend.bake
        cb = graphed(model, backend, canary=gg.Canary(every=1, on_divergence="raise"))
        try:
            run(cb)  # captured with 0: graph == eager
            shift["value"] = 1
            with pytest.raises(DivergenceError):
                run(cb)
        finally:
            cb.close()


def test_an_argument_that_cannot_key_a_graph_is_refused(monkeypatch):
    from transformers.generation.continuous_batching import input_outputs as hf_io

    kwargs = hf_io.ContinuousBatchingIOs.get_model_kwargs

    def get_model_kwargs(self, use_padding=False):  # type: ignore[no-untyped-def]
        out = kwargs(self, use_padding=use_padding)
        out["opaque"] = object()
        return out

    monkeypatch.setattr(hf_io.ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)
    cb = graphed(F.model("llama"))
    try:
        with pytest.raises(UnsupportedModelError, match=r"batch_data\['opaque'\] is a object"):
            run(cb)
    finally:
        cb.close()


# ---------------------------------------------------------------- weights


def test_rl_loop_update_weights_between_calls_equals_fresh_eager_engines():
    model = F.model("qwen2", seed=0)
    cb = graphed(model)
    try:
        for round_ in range(4):
            new = F.model("qwen2", seed=100 + round_).state_dict()
            cb.update_weights(new)
            fresh = F.model("qwen2", seed=0)
            fresh.load_state_dict(new)
            assert run(cb) == hf_eager(fresh), round_
        assert cb.check_weights()[0]
        st = cb.stats()
        assert st["captured"] == st["keys"]
    finally:
        cb.close()


# ---------------------------------------------------------------- refusals


def test_hf_own_graphs_async_and_compile_are_refused():
    cb = graphed(F.model("llama"))
    for kw, match in (
        ({"use_cuda_graph": True}, "use_cuda_graph=True"),
        ({"use_async_batching": True}, "use_async_batching=True"),
    ):
        with pytest.raises(ConfigError, match=match):
            cb.generate_batch(
                PROMPTS, generation_config=gen(), continuous_batching_config=cbc(**kw)
            )
    cb.close()


def test_settings_changed_between_calls_are_refused():
    cb = graphed(F.model("llama"))
    try:
        run(cb)
        with pytest.raises(ConfigError, match="close\\(\\) first"):
            run(cb, new=3)
    finally:
        cb.close()


def test_transformers_out_of_range_or_changed_internals_are_refused(monkeypatch):
    model = F.model("llama")
    monkeypatch.setattr(hf_continuous, "TRANSFORMERS_VERSION", "6.1.0")
    with pytest.raises(UnsupportedModelError, match=r"transformers 6\.1\.0 is outside"):
        graphed(model)
    monkeypatch.setattr(hf_continuous, "TRANSFORMERS_VERSION", "5.17.0")
    monkeypatch.setattr(_hf_cb_keys, "RUNNER_ATTRS", (*_hf_cb_keys.RUNNER_ATTRS, "gone_in_6"))
    cb = graphed(model)
    try:
        with pytest.raises(UnsupportedModelError, match=r"transformers 5\.17\.0 has no gone_in_6"):
            run(cb)
    finally:
        cb.close()


def test_options_set_here_and_capture_now_are_refused():
    model = F.model("llama")
    with pytest.raises(ConfigError, match="sets sizes= itself"):
        graphed(model, sizes=[1, 2])
    with pytest.raises(ConfigError, match="capture_now"):
        graphed(model, lazy=gg.Lazy(capture_now=[1]))


def test_context_manager_graphs_managers_built_inside_it():
    model = F.model("llama", seed=7)
    want = hf_eager(model)
    with graph_continuous_batching(model, backend=gg.RecordingBackend(), progress=False) as g:
        got = tokens(
            model.generate_batch(
                PROMPTS,
                generation_config=gen(),
                continuous_batching_config=cbc(),
                progress_bar=False,
            )
        )
        assert g.stats()["captured"] >= 1
    assert got == want
    assert "init_continuous_batching" not in vars(model)  # the patch is gone
    assert copy.copy(want) == hf_eager(model)  # HF's own engine unchanged after


def test_per_request_lengths_through_the_manager_equal_hf_eager():
    """The manager API (what ``transformers serve`` drives): requests of different
    generation lengths join and leave; tokens equal HF's eager engine, request by request."""
    model = F.model("qwen2", seed=9)
    new = [3, 9, 5, 12, 1]
    kw = {"generation_config": gen(12), "continuous_batching_config": cbc()}
    want = run_requests(model, PROMPTS, new, **kw)["tokens"]
    with graph_continuous_batching(model, backend=gg.RecordingBackend(), progress=False) as g:
        got = run_requests(model, PROMPTS, new, **kw)
        assert g.stats()["keys"] >= 2
    assert got["tokens"] == want
    assert [len(t) for t in want] == new


# ---------------------------------------------------------------- prefix cache vs weights


def long_prompts(n: int = 6, seed: int = 1, shared: int = 0) -> list[list[int]]:
    """Prompts of 40..69 tokens (2-4 full 16-token pages each), the first ``shared``
    tokens common to all (a system prompt)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 101, (shared,), generator=g).tolist()
    lens = torch.randint(40, 70, (n,), generator=g).tolist()
    return [head + torch.randint(3, 101, (k - shared,), generator=g).tolist() for k in lens]


def long_cbc(**kw: Any) -> Any:
    return cbc(num_blocks=96, **kw)


def run_long(cb: GraphedContinuousBatching, ps: list[list[int]]) -> list[list[int]]:
    return tokens(
        cb.generate_batch(ps, generation_config=gen(), continuous_batching_config=long_cbc())
    )


def eager_long(model: Any, ps: list[list[int]], **kw: Any) -> list[list[int]]:
    out = model.generate_batch(
        ps,
        generation_config=gen(),
        continuous_batching_config=long_cbc(),
        progress_bar=False,
        **kw,
    )
    return tokens(out)


def caches(cb: GraphedContinuousBatching) -> list[Any]:
    return [cache for cache, _ in cb._prefix_caches()]


def as_source(kind: str, model: Any, new: dict[str, Any]) -> Any:
    """``new`` as each source ``update_weights`` takes."""
    if kind == "state_dict":
        return new
    if kind == "module":
        m = F.model("qwen2", seed=0)
        m.load_state_dict(new)
        return m
    return lambda: model.load_state_dict(new)  # a loader: loads in place


@pytest.mark.parametrize("shared", [0, 32])
def test_rl_loop_long_prompts_never_reuse_kv_of_old_weights(shared):
    """Prompts spanning full pages, the same every round: HF's prefix cache keeps their
    blocks' hashes across ``generate_batch`` calls; every kind of weight update drops them,
    so every round equals a fresh eager engine with its weights (before the fix, round 0
    re-used the first call's KV, computed with the old weights)."""
    model = F.model("qwen2", seed=0)
    ps = long_prompts(shared=shared)
    cb = graphed(model)
    try:
        assert run_long(cb, ps) == eager_long(F.model("qwen2", seed=0), ps)
        keys = cb.stats()["keys"]
        for round_, kind in enumerate(("state_dict", "module", "loader")):
            (cache,) = caches(cb)
            assert _hf_cb_prefix.hashed(cache) > 0  # the last call's pages, kept
            new = F.model("qwen2", seed=100 + round_).state_dict()
            cb.update_weights(as_source(kind, model, new))
            assert _hf_cb_prefix.hashed(cache) == 0, kind
            fresh = F.model("qwen2", seed=0)
            fresh.load_state_dict(new)
            assert run_long(cb, ps) == eager_long(fresh, ps), (round_, kind)
        st = cb.stats()
        assert st["captured"] == st["keys"] == keys  # every round steps as the first did
    finally:
        cb.close()


def test_hf_own_persistent_engine_serves_old_weights_kv_after_an_in_place_load():
    """The hazard is HF's own (no graphguard here): a persistent manager, the same long
    prompts after ``load_state_dict``, tokens differ from a fresh engine's; dropping the
    prefix cache (what ``update_weights`` does) makes them equal."""
    ps = long_prompts()
    new = F.model("qwen2", seed=100).state_dict()
    fresh = F.model("qwen2", seed=0)
    fresh.load_state_dict(new)
    want = eager_long(fresh, ps)
    for drop in (False, True):
        model = F.model("qwen2", seed=0)
        try:
            eager_long(model, ps, persistent_manager=True)
            with torch.no_grad():
                model.load_state_dict(new)
            cache = model._cached_continuous_batching_manager.batch_processor.cache
            assert _hf_cb_prefix.hashed(cache) > 0
            if drop:
                _hf_cb_prefix.drop(cache, hf_continuous.TRANSFORMERS_VERSION, free_requests=True)
            got = eager_long(model, ps, persistent_manager=True)
            assert (got == want) is drop
        finally:
            model.destroy_cached_continuous_batching_manager()


def test_update_before_any_graph_drops_the_cached_hf_managers_prefix_cache():
    """A persistent manager HF built before graphguard saw it (no graph yet): the plain
    in-place load drops its prefix cache too, and the next call (graphed on that manager)
    equals a fresh engine."""
    model = F.model("qwen2", seed=0)
    ps = long_prompts(seed=3)
    eager_long(model, ps, persistent_manager=True)
    cb = graphed(model)
    try:
        new = F.model("qwen2", seed=101).state_dict()
        cb.update_weights(new)
        assert not cb.engines and all(_hf_cb_prefix.hashed(c) == 0 for c in caches(cb))
        fresh = F.model("qwen2", seed=0)
        fresh.load_state_dict(new)
        assert run_long(cb, ps) == eager_long(fresh, ps)
        assert cb.stats()["captured"] >= 1
    finally:
        cb.close()


def test_update_with_requests_in_flight_and_sharing_on_is_refused(monkeypatch):
    """A running manager whose requests hold blocks: their pages would be hashed (and
    shared) with old-weight KV after the update; refused before anything is loaded."""
    model = F.model("qwen2", seed=0)
    cb = graphed(model)
    try:
        run_long(cb, long_prompts())
        (cache,) = caches(cb)
        manager = cb.engines[0].manager_ref()
        monkeypatch.setattr(manager, "is_running", lambda: True)
        alloc = next(iter(_hf_cb_prefix._allocators(cache)))
        monkeypatch.setitem(alloc.block_table, "req_in_flight", [])
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ConfigError, match="hold blocks of HF's paged cache"):
            cb.update_weights(F.model("qwen2", seed=100).state_dict())
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert _hf_cb_prefix.hashed(cache) > 0  # untouched: nothing was loaded
    finally:
        cb.close()


def test_unknown_paged_cache_layout_is_refused_naming_the_version(monkeypatch):
    model = F.model("qwen2", seed=0)
    cb = graphed(model)
    try:
        run_long(cb, long_prompts())
        monkeypatch.setattr(_hf_cb_prefix, "layout", lambda cache: None)
        with pytest.raises(
            UnsupportedModelError, match=r"in transformers 5\.\d+.*nothing was loaded"
        ):
            cb.update_weights(F.model("qwen2", seed=100).state_dict())
    finally:
        cb.close()


# ---------------------------------------------------------------- the per-step host path


def test_per_step_key_equals_the_checked_key_and_replays_copy_nothing():
    """The per-step signature (exact types, no argument paths) is the checked one's value
    (by value, storage and layout), a step whose key has a graph replays through the
    zero-copy path (no copy into the runner's static input), and a dict subclass or an
    int subclass takes the checked path with the same result."""
    import enum

    from torch.utils._python_dispatch import TorchDispatchMode

    model = F.model("llama", seed=3)
    cb = graphed(model)
    try:
        run(cb)
        steps = cb.steps
        assert steps is not None
        for slot in steps.slots.values():
            _, bd = steps._data[slot]
            flags = (False, False, None, False)
            fast = _hf_cb_keys.signature(bd, steps._out_buffers, flags)
            slow = (
                _hf_cb_keys._sig(bd, "batch_data"),
                _hf_cb_keys._sig(steps._out_buffers, "outputs"),
                flags,
            )
            assert fast == slow and hash(fast) == hash(slow)
            assert steps.slots[steps._signature(bd)] == slot

            class Odd(enum.IntEnum):
                ONE = 1

            odd = type("D", (dict,), {})(bd, extra=Odd.ONE)
            want = (_hf_cb_keys._sig(odd, "batch_data"), fast[1], flags)
            assert _hf_cb_keys.signature(odd, steps._out_buffers, flags) == want

        class Ops(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.ops: list[str] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        slot = max(steps.slots.values())
        _, bd = steps._data[slot]
        # The forward replaced by a no-op: the recorded arguments' buffers hold a later
        # step's values by now (RecordingBackend runs the body on a replay).
        steps._data[slot] = (lambda *a: None, bd)
        replays = steps.runner.stats().sizes
        before = {r.size: r.replays for r in replays}[slot]
        with Ops() as ops:
            steps.compute_batch(model, bd)
        static = steps.runner.static_inputs(slot)[0]
        assert {r.size: r.replays for r in steps.runner.stats().sizes}[slot] == before + 1
        # The body's own ops only (RecordingBackend runs the step): nothing written into
        # the slot's static input.
        assert not any("copy" in op and "foreach" in op for op in ops.ops), ops.ops
        assert static.shape[0] == slot
    finally:
        cb.close()


# ---------------------------------------------------------------- serving edges (issue 38)


@contextlib.contextmanager
def raising_on(monkeypatch, token: int):  # type: ignore[no-untyped-def]
    """HF's step raises whenever its batch holds ``token`` (a valid id: a stand-in for any
    exception a step may raise, past the up-front checks)."""
    original = hf_runner.ModelRunner._forward_process_and_sample

    def step(self, model, batch_data, carry, prev, out):  # type: ignore[no-untyped-def]
        original(self, model, batch_data, carry, prev, out)
        if bool((batch_data["input_ids"] == token).any()):
            raise RuntimeError(f"planted step failure on token {token}")

    monkeypatch.setattr(hf_runner.ModelRunner, "_forward_process_and_sample", step)
    yield


def canary_divergences(cb: GraphedContinuousBatching) -> tuple[int, int]:
    stats = cb.canary_stats().values()
    return sum(s.checks for s in stats), sum(s.divergences for s in stats)


def test_a_step_that_raises_on_a_new_key_leaves_nothing_and_the_next_call_is_right(monkeypatch):
    """Issue 38: the step that introduced a key raised while the key was being captured;
    before the fix its refused slot padded up to a slot with no key, whose graph ran no
    step (all-zero tokens, FINISHED, 12 of 12 canary divergences), and HF's own
    generate_batch on the same model served zeros too. Now the key is forgotten, its slot
    retired, and the next call (and HF's generate_batch on the kept engine) equals HF."""
    model = F.model("llama", seed=0)
    want = hf_eager(model)
    with raising_on(monkeypatch, 99):
        cb = graphed(model, canary=gg.Canary(every=1))
        try:
            with pytest.raises(RuntimeError, match="planted step failure"):
                run(cb, [[5, 6, 99]])
            st = cb.stats()
            assert st["failed_keys"] == 1 and st["keys"] == 0 and st["captured"] == 0
            assert run(cb) == want
            assert canary_divergences(cb)[1] == 0 and canary_divergences(cb)[0] > 0
            st = cb.stats()
            assert st["captured"] == st["keys"] >= 1
            assert all(r["status"] == "captured" and r["key"] for r in st["per_key"])
            assert 1 not in [r["slot"] for r in st["per_key"]]  # retired: a fresh capture
            # HF's own generate_batch re-uses the kept engine (its steps are graphguard's).
            assert hf_eager(model) == want
        finally:
            cb.close()


def test_a_step_that_raises_after_its_new_key_ran_leaves_no_key_or_graph(monkeypatch):
    """The first step of a new key (its first call: run eagerly as the key's warmup)
    raises after its forward ran: the error propagates, nothing is captured, the key is
    dropped, and the next call equals HF's eager engine."""
    original = hf_runner.ModelRunner._forward_process_and_sample
    runs: list[int] = []

    def step(self, model, batch_data, carry, prev, out):  # type: ignore[no-untyped-def]
        original(self, model, batch_data, carry, prev, out)
        if bool((batch_data["input_ids"] == 99).any()):
            runs.append(1)
            raise RuntimeError("planted failure after the forward")

    model = F.model("llama", seed=0)
    want = hf_eager(model)
    monkeypatch.setattr(hf_runner.ModelRunner, "_forward_process_and_sample", step)
    cb = graphed(model)
    try:
        with pytest.raises(RuntimeError, match="after the forward"):
            run(cb, [[5, 6, 99]])
        assert len(runs) == 1  # the first call raised: not run again
        st = cb.stats()
        assert st["failed_keys"] == 1 and st["keys"] == 0
        assert cb.steps is not None and cb.steps.runner.captured_sizes == ()
        assert run(cb) == want
    finally:
        cb.close()


def test_a_step_that_raises_on_a_captured_key_keeps_its_graph(monkeypatch):
    """The same failure on keys that already have graphs (prompts of the same lengths):
    the call fails, the graphs captured from good steps stay, nothing is recaptured, and
    the next call equals HF's eager engine."""
    model = F.model("qwen2", seed=1)
    want = hf_eager(model)
    backend = gg.RecordingBackend()
    with raising_on(monkeypatch, 99):
        cb = graphed(model, backend, canary=gg.Canary(every=1))
        try:
            assert run(cb) == want
            captures, keys = backend.names().count("capture_end"), cb.stats()["keys"]
            bad = [[*p[:-1], 99] for p in PROMPTS]  # the same lengths: the same keys
            with pytest.raises(RuntimeError, match="planted step failure"):
                run(cb, bad)
            assert run(cb) == want
            assert cb.stats()["keys"] == keys and cb.stats()["failed_keys"] == 0
            assert backend.names().count("capture_end") == captures
            assert canary_divergences(cb)[1] == 0
        finally:
            cb.close()


class FailingBackend(gg.RecordingBackend):
    """RecordingBackend whose capture of the first graph slot fails (the step itself runs
    fine eagerly): a key whose capture fails, as an unsupported op or an OOM would."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_on = {1}


def test_a_key_whose_capture_failed_runs_eagerly_never_on_another_keys_graph():
    """Slot 1's capture fails, so the runner refuses size 1 and would pad its batches up to
    size 2: another key's graph. Each step of slot 1's key runs HF's step eagerly instead;
    tokens equal HF's eager engine and the canary (every replay) sees no divergence."""
    model = F.model("llama", seed=3)
    want = hf_eager(model)
    cb = graphed(model, FailingBackend(), canary=gg.Canary(every=1))
    try:
        assert run(cb) == want
        assert run(cb) == want  # the refused key again, on the same engine
        st = cb.stats()
        rows = {r["slot"]: r for r in st["per_key"]}
        assert rows[1]["status"] == "failed" and rows[1]["eager"] >= 2
        # The runner's: its first call (the warmup), then the failed capture's eager call.
        assert st["eager_refused"] == rows[1]["eager"] - 2
        assert all(r["status"] == "captured" for s, r in rows.items() if s != 1)
        assert canary_divergences(cb)[1] == 0
    finally:
        cb.close()


def test_steps_are_captured_without_grad_when_hf_builds_the_engine_in_its_thread():
    """``warmup=False``: HF builds its batch processor in its generation thread, where
    grad is on; before the fix the runner captured every key with grad on, HF's in-place
    KV write failed on a leaf that requires grad, and the refused keys padded to empty
    slots (tokens after the first all zeros)."""
    model = F.model("llama", seed=2)
    want = hf_eager(model)
    cb = graphed(model)
    try:
        out = cb.generate_batch(
            PROMPTS, generation_config=gen(), continuous_batching_config=cbc(), warmup=False
        )
        assert tokens(out) == want
        st = cb.stats()
        assert st["keys"] >= 2 and graphed_once_used_twice(st)
    finally:
        cb.close()


def test_hf_warmup_is_skipped_off_cuda():
    """HF's warmup captures its largest key (``max_batch_tokens`` queries over the whole
    cache) to size a CUDA pool: off CUDA it is skipped, so no key of that size exists."""
    model = F.model("llama", seed=2)
    cb = graphed(model)
    try:
        run(cb)
        assert all(r["hf_key"][0] < 64 for r in cb.stats()["per_key"])  # max_batch_tokens
        processor = cb.steps.processor_ref()  # type: ignore[union-attr,misc]
        assert processor.model_runner.warmup is _hf_cb_install.no_warmup
    finally:
        cb.close()


BAD_INPUTS = [
    ([[5, 6, 1000]], r"inputs\[0\]\[2\] is 1000, outside the vocabulary \[0, 101\)"),
    ([[5, 6], [7, -1]], r"inputs\[1\]\[1\] is -1, outside the vocabulary"),
    ([[5.0, 6.5, 7.0]], r"inputs\[0\]\[0\] is 5\.0 \(float\), not an int"),
    ([[5, 6], [7, 6.5]], r"inputs\[1\]\[1\] is 6\.5 \(float\), not an int"),
    ([[5, True]], r"inputs\[0\]\[1\] is True \(bool\), not an int"),
    ([[]], r"inputs\[0\] is empty"),
    ([[5, 6], []], r"inputs\[1\] is empty"),
    (torch.tensor([[5.0, 6.0], [7.0, 8.0]]), r"inputs is a Tensor of torch\.float32"),
    (torch.tensor([[5, 6], [7, 8]]), r"inputs is a Tensor of torch\.int64 .*tolist"),
    ([torch.tensor([5.0, 6.0])], r"inputs\[0\] is a torch\.float32 tensor"),
    ([5, 6, 7], r"inputs\[0\] is a int, not a list of ids"),
]


def test_bad_prompts_are_refused_by_name_before_anything_runs():
    """Issue 38: token ids past the vocabulary, floats, bools, empty prompts and tensors
    of prompts: a ConfigError naming ``inputs[i][j]``, the value and what to pass; no
    engine, key or setting is kept, and the next good call equals HF's eager engine."""
    model = F.model("llama", seed=6)
    want = hf_eager(model)
    cb = graphed(model)
    try:
        for bad, match in BAD_INPUTS:
            with pytest.raises(ConfigError, match=match) as err:
                run(cb, bad)
            assert "nothing was run" in str(err.value) and "generate_batch" in str(err.value)
            assert cb.engines == [] and cb._settings is None
        # Integer tensors, numpy ints and tuples are token ids too.
        import numpy as np

        mixed = [torch.tensor(PROMPTS[0]), tuple(PROMPTS[1]), np.array(PROMPTS[2]), *PROMPTS[3:]]
        assert run(cb, mixed) == want
        assert run(cb, []) == []
    finally:
        cb.close()


def test_lazy_false_is_refused_and_lazy_true_is_lazy():
    """Issue 38: ``lazy=False`` was accepted and every key still captured lazily. A key
    exists only at serving time: refused, naming what to pass."""
    model = F.model("llama")
    with pytest.raises(ConfigError, match=r"lazy=False.*no key can be captured before serving"):
        graphed(model, lazy=False)
    cb = graphed(model, lazy=True)
    try:
        run(cb)
        assert cb.stats()["captured"] >= 1
    finally:
        cb.close()


def test_max_new_tokens_per_request_equals_hf_eager_manager():
    """One generation budget per prompt (RL rollouts): each request through HF's manager
    with its own ``max_new_tokens``, equal to HF's eager engine request by request."""
    model = F.model("qwen2", seed=9)
    new = [3, 9, 5, 12, 1]
    kw = {"generation_config": gen(12), "continuous_batching_config": cbc()}
    want = run_requests(model, PROMPTS, new, **kw)["tokens"]
    cb = graphed(model)
    try:
        got = tokens(cb.generate_batch(PROMPTS, max_new_tokens=new, **kw))
        assert got == want and [len(t) for t in got] == new
        with pytest.raises(ConfigError, match=r"max_new_tokens has 2 values"):
            cb.generate_batch(PROMPTS, max_new_tokens=[3, 4], **kw)
        with pytest.raises(ConfigError, match=r"max_new_tokens\[1\] is 0"):
            cb.generate_batch(PROMPTS, max_new_tokens=[3, 0, 1, 1, 1], **kw)
    finally:
        cb.close()


@pytest.mark.parametrize("bad", [-1, 0, True])
def test_max_new_tokens_below_one_is_refused_as_one_int_as_in_the_list(bad: Any) -> None:
    """HF took ``max_new_tokens=-1`` (or 0) and returned every request FINISHED and empty
    while its engine still ran forward steps; the per-prompt list refused the same values.
    Both forms are refused alike, before anything runs."""
    model = F.model("qwen2", seed=9)
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    kw = {"generation_config": gen(4), "continuous_batching_config": cbc()}
    cb = graphed(model)
    fix = r"; pass one int >= 1 for every request \(5\), or one int for all"
    try:
        with pytest.raises(ConfigError, match=rf"max_new_tokens is {bad!r}{fix}"):
            cb.generate_batch(PROMPTS, max_new_tokens=bad, **kw)
        with pytest.raises(ConfigError, match=rf"max_new_tokens\[2\] is {bad!r}{fix}"):
            cb.generate_batch(PROMPTS, max_new_tokens=[3, 3, bad, 3, 3], **kw)
        assert forwards == []  # nothing ran
        got = tokens(cb.generate_batch(PROMPTS, max_new_tokens=2, **kw))  # still serves
        assert [len(t) for t in got] == [2] * len(PROMPTS)
    finally:
        cb.close()


# ---------------------------------------------------------------- weight_sync (issue 42)


def test_weight_sync_copies_the_trainers_module_and_reproves_the_addresses():
    """``weight_sync(policy)`` validated once; each call copies the policy in place and
    the next rollout equals a fresh eager engine with those weights. A source tensor the
    trainer re-created (rebound, or its storage swapped) is read as it now is (the full
    update path, then a rebuilt sync); an engine tensor moved after capture is refused
    before anything is copied (``WeightsMovedError``), by address as by rebinding."""
    from graphguard.errors import WeightsMovedError

    model = F.model("qwen2", seed=0)
    policy = F.model("qwen2", seed=50)
    cb = graphed(model)
    try:
        sync = cb.weight_sync(policy)
        run(cb)  # graphs captured after the sync was built: recorded the same tensors
        for round_ in range(3):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01 * (round_ + 1))
            if round_ == 1:  # the trainer re-creates one parameter
                w = policy.model.layers[0].mlp.up_proj.weight
                policy.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(w + 0.5)
            if round_ == 2:  # and swaps another's storage
                w = policy.model.layers[1].mlp.down_proj.weight
                w.data = w.data.clone() - 0.5
            update = sync()
            assert update.bytes > 0 and len(update.copied) == len(sync.names)
            fresh = F.model("qwen2", seed=0)
            fresh.load_state_dict(policy.state_dict())
            assert run(cb) == hf_eager(fresh), round_
        assert sync.rebuilt == 1  # the rebinding; the .data swap is read as it is
        before = {k: v.clone() for k, v in model.state_dict().items()}
        moved = model.model.layers[1].self_attn.q_proj
        moved.weight = torch.nn.Parameter(moved.weight.detach().clone())
        with pytest.raises(WeightsMovedError, match=r"q_proj\.weight"):
            sync()
        now = model.state_dict()
        assert all(torch.equal(before[k], now[k]) for k in before)  # nothing copied
        with pytest.raises(ConfigError, match="weight_sync needs the trainer's module"):
            cb.weight_sync(policy.state_dict())  # type: ignore[arg-type]
    finally:
        cb.close()


def test_weight_sync_counts_versions_around_its_copy_and_names_a_tensor_it_did_not_write():
    """Every call reads the version counter of every engine name its copy writes (tied
    names too) before and after launching the copy: a clean call names none unchanged; a
    copy that leaves one tensor out (planted: its pair removed from the sync's buckets)
    has that name, and only it, in ``versions_unchanged``."""
    model = F.model("llama", seed=0)
    policy = F.model("llama", seed=50)
    cb = graphed(model)
    try:
        run(cb)
        sync = cb.weight_sync(policy)
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        update = sync()
        assert names <= set(update.versions_checked) and update.versions_unchanged == ()
        assert update.refit is not None and update.refit.ok
        skipped = "model.layers.1.mlp.down_proj.weight"
        target = model.get_parameter(skipped)
        for dl, sl in sync._buckets:
            at = next((i for i, d in enumerate(dl) if d is target), None)
            if at is not None:
                del dl[at], sl[at]
        update = sync()
        assert update.versions_unchanged == (skipped,)
    finally:
        cb.close()


def test_weight_sync_refuses_a_source_of_another_dtype_by_name():
    model = F.model("llama", seed=0)
    cb = graphed(model)
    try:
        with pytest.raises(ConfigError, match=r"expected float32 .* got float64"):
            cb.weight_sync(F.model("llama", seed=0, dtype=torch.float64))
    finally:
        cb.close()
