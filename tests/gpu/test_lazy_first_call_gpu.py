"""The lazy default on real CUDA graphs (issue 41): a size's first call runs eagerly as its
warmup and the next call captures it warm; graphs live inside a byte budget by eviction.

1. Reference 1B decode step (bf16, cuDNN decode attention): the first call at a size is
   bitwise equal to eager at the padded size, counted as the size's warmup; the next call
   captures with no eager forward (``prewarmed``, 0 warmups) and it and every later
   replay are bitwise equal to eager at the padded size.
2. Hugging Face Llama (small, bf16): ``GraphedCausalLM(lazy=True)`` generates the tokens
   of HF's eager ``generate``; each decode size's first step was its warmup.
3. Eviction with real memory: the reference step on a skewed serving trace at 25% of
   the ladder's graph bytes (``bench/bench_evict.py`` in a fresh process): evictions and
   recaptures happen, outputs stay bitwise equal to eager, the ledger stays within the
   budget and within 5% of the free device memory the graphs hold. The HF Llama variant
   is a strict xfail (one shared pool: its budget never binds; see the test).
4. A step that reseeds the CUDA generator: its first call's result is returned, the size
   refused (a graph cannot replay the reseed).

Run on the GPU machine: ``python -m pytest tests/gpu/test_lazy_first_call_gpu.py -rA -s``
(about 50 s on an H200: the 1B model built twice, once in the eviction test's own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import graphguard as gg

MIB = float(1 << 20)
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("no_tf32")  # conftest.py: fp32 GEMMs without TF32


def say(*args: object) -> None:
    print("[lazy-first-call]", *args, flush=True)


def padded(inputs: tuple[torch.Tensor, ...], fills: tuple[int, ...], size: int) -> list[Any]:
    """``inputs`` with fill rows up to ``size``: the batch a padded replay computes on."""
    n = inputs[0].shape[0]
    return [
        torch.cat([x, torch.full((size - n, *x.shape[1:]), f, dtype=x.dtype, device=x.device)])
        for x, f in zip(inputs, fills)
    ]


@torch.inference_mode()
def test_reference_step_first_call_is_eager_at_the_padded_size_then_captured_warm() -> None:
    from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel

    cfg = LlamaConfig.preset("llama-1b", max_batch=32, max_context=512)
    model = LlamaDecodeModel.random(cfg, device=torch.device("cuda"), dtype=torch.bfloat16, seed=0)
    sizes = [1, 2, 4, 8, 16, 24, 32]
    fills = model.pad_fill_values()
    runner = gg.GraphRunner(
        model.decode_step, model.example_inputs(2), sizes=sizes, fill_values=fills,
        before_capture=[model.warm_kernels], workspaces=[model.workspace], state=[],
        progress=False, lazy=True, name="first-call-ref",
    )  # fmt: skip
    runner.capture()
    gen = torch.Generator().manual_seed(41)
    for n in (3, 8, 20):
        x = model.example_inputs(n, generator=gen)
        size = runner.padded_size(n)
        assert size is not None
        got = [runner(*x).clone() for _ in range(3)]  # first call, capture, replay
        want = model.decode_step(*padded(x, fills, size))[:n]
        row = runner.stats().size(size)
        say(
            f"batch {n} -> size {size}: first call bitwise {torch.equal(got[0], want)}, "
            f"capture {torch.equal(got[1], want)}, replay {torch.equal(got[2], want)}; "
            f"warmup calls {row.warmup_calls}, prewarmed {row.prewarmed}, warmups "
            f"{row.warmups}, capture total {row.phases_ms.get('total')} ms"
        )
        assert all(torch.equal(g, want) for g in got), f"batch {n}: not bitwise eager"
        assert (row.status, row.warmup_calls, row.prewarmed, row.warmups) == (
            "captured",
            1,
            True,
            0,
        )
        assert row.phases_ms["warmup"] == 0.0
    st = runner.stats()
    assert st.eager_reasons == {"first call: the size's warmup": 3}
    assert runner.captured_sizes == (4, 8, 24)
    runner.release()


def _hf_llama(layers: int = 4) -> Any:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _hf_eager(model: Any, ids: torch.Tensor, new: int) -> torch.Tensor:
    out: torch.Tensor = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
        cache_implementation="static", disable_compile=True,
    )  # fmt: skip
    return out


@torch.inference_mode()
def test_hf_llama_generates_hf_tokens_with_each_sizes_first_decode_step_as_its_warmup() -> None:
    from graphguard.integrations.transformers import GraphedCausalLM

    model = _hf_llama()
    g = GraphedCausalLM(model, max_batch=8, max_cache_len=64, progress=False, lazy=True)
    g.capture()
    gen = torch.Generator().manual_seed(5)
    for b in (3, 5, 3):
        ids = torch.randint(3, 4096, (b, 12), generator=gen).cuda()
        got = g.generate(ids, torch.ones_like(ids), max_new_tokens=6)
        assert torch.equal(got, _hf_eager(model, ids, 6)), f"batch {b}: tokens differ"
    st = g.stats()
    rows = {s.size: s for s in st.sizes if s.warmup_calls}
    say(
        "HF lazy default: "
        + ", ".join(
            f"size {s}: {r.status}, warmup calls {r.warmup_calls}, replays {r.replays}, "
            f"prewarmed {r.prewarmed}"
            for s, r in rows.items()
        )
    )
    assert sorted(rows) == [4, 8] and all(r.warmup_calls == 1 for r in rows.values())
    assert all(r.status == "captured" and r.prewarmed for r in rows.values())
    g.release()


def test_eviction_on_a_serving_trace_keeps_the_budget_and_the_ledger_true(tmp_path: Path) -> None:
    """The reference 1B step on 400 calls of ``bench/bench_evict.py``'s skewed trace, with a
    budget of 25% of the full ladder's graph bytes and ``evict="lru"``: with one shared pool
    the budget binds on the pool (a size whose capture grows it past the budget), so graphs
    are evicted until the pool goes and the hot sizes are captured again into a fresh one.
    A fresh process: its free-memory reads see no earlier test's graphs. ``--budgets`` and
    ``--modes`` pick the one run; the bench checks every 25th output against eager."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "ref" / "src"),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    cmd = [sys.executable, str(ROOT / "bench" / "bench_evict.py"), "--calls", "400",
           "--budgets", "0.25", "--modes", "lru", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("lazy-evict_*.json")
    (run,) = json.loads(path.read_text())["runs"]
    say(
        f"eviction, reference 1B step: budget {run['budget_bytes'] / MIB:.1f} MiB, "
        f"{run['evictions']} evictions, {run['recaptures']} recaptures, hit rate "
        f"{run['hit_rate']:.1%}, ledger max {run['max_ledger_bytes'] / MIB:.1f} MiB, gap "
        f"{run['ledger_vs_measured_max_gap']}, captured at the end {run['captured_at_end']}"
    )
    assert run["oom_errors"] == 0 and run["outputs_not_bitwise"] == 0
    assert run["evictions"] >= 1 and run["recaptures"] >= 1
    assert run["max_ledger_bytes"] <= run["budget_bytes"]
    assert run["within_5_percent"], [
        (c["ledger_bytes"], c["measured_bytes"]) for c in run["timeline"]
    ]


# The HF eviction test stays a strict xfail: with one shared pool the decode graphs of sizes
# 1-8 share the pool of the largest, and a lazily captured graph's driver share reads 0 in a
# process that released graphs before (the driver reuses their memory): at 6443612 a 96-layer
# Llama's four graphs took 14 MiB of driver memory captured up front, and none captured
# lazily after that probe was released; the ledger matched free memory (34 MiB both), so the
# budget never bound (bench/results/gpu-tests-serial-6443612_NVIDIA-H200_2026-12-02.log). A
# pool per lazily captured size made it pass (649b0ca) but lost on the serving trace (each
# pool whole allocator segments and its own 34 MiB of cuBLAS workspaces: hit rate 1.2% at
# 25% of the ladder's bytes against 35% sharing one pool). Eviction on real memory is shown
# on the reference step above and by bench/bench_evict.py.
EVICT_HF_LAYERS = 96


@pytest.mark.xfail(strict=True, reason="one shared pool: the budget never binds (see above)")
@torch.inference_mode()
def test_hf_llama_evicts_decode_graphs_and_keeps_hf_tokens() -> None:
    from graphguard.integrations.transformers import GraphedCausalLM

    model = _hf_llama(layers=EVICT_HF_LAYERS)
    probe = GraphedCausalLM(model, max_batch=8, max_cache_len=64, progress=False)
    report = probe.capture()  # sizes 1, 2, 4, 8: one graph's driver share, page-averaged
    budget = report.pool_bytes + int(1.5 * report.driver_bytes / len(report.sizes))
    probe.release()
    g = GraphedCausalLM(
        model, max_batch=8, max_cache_len=64, progress=False,
        lazy=gg.Lazy(budget=budget, evict="lru"),
    )  # fmt: skip
    g.capture()
    gen = torch.Generator().manual_seed(6)
    for b in (8, 1, 2, 4, 8, 1):
        ids = torch.randint(3, 4096, (b, 10), generator=gen).cuda()
        got = g.generate(ids, torch.ones_like(ids), max_new_tokens=5)
        assert torch.equal(got, _hf_eager(model, ids, 5)), f"batch {b}: tokens differ"
        assert g.runner.door.ledger.used <= budget
    st = g.stats()
    say(
        f"HF eviction: graphs of 1-8 pool {report.pool_bytes / MIB:.1f} + driver "
        f"{report.driver_bytes / MIB:.1f} MiB; budget {budget / MIB:.1f} MiB, "
        f"{st.evictions} evictions, captured "
        f"{list(g.captured_sizes)}, recaptures { {s.size: s.recaptures for s in st.sizes} }"
    )
    assert st.evictions >= 1
    g.release()


@torch.inference_mode()
def test_a_step_that_reseeds_the_generator_is_served_once_and_refused() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        torch.cuda.manual_seed(1234)  # eagerly: the same numbers every call
        return x + torch.rand_like(x)

    runner = gg.GraphRunner(
        step, (torch.zeros(2, 16, device="cuda"),), sizes=[4, 8], lazy=True, state=[],
        progress=False, name="reseeds",
    )  # fmt: skip
    runner.capture()
    x = torch.zeros(4, 16, device="cuda")
    first = runner(x).clone()
    row = runner.stats().size(4)
    say(f"reseed: size 4 {row.status}: {row.note}")
    assert row.status == "failed" and "reseeded or rewound generator 'default'" in (row.note or "")
    torch.testing.assert_close(first, step(x))  # the eager result, served
