"""Every graph mode on the reference model's mixed step equals eager, over >= 1,000 engine steps.

One random engine run (same seed in every mode): requests join and finish, prefill
prompts in chunks, decode (q = 1) or verify K = 2 draft tokens (q = 3); the live count
jumps between 1 and 16, so consecutive steps move between captured sizes (48 -> 3 and
the like). The batches go through a :class:`~graphguard.dispatch.Dispatcher` built by
:func:`graphguard_ref.serving_loop.build_dispatcher` in mode NONE, PIECEWISE, FULL or
FULL_AND_PIECEWISE, on a model whose KV cache only the dispatcher writes; an
independent eager model (same weights, its own cache) runs every batch too. Greedy
tokens come from the eager model, so every mode sees the same sequence of batches.

Checked per step: logits within a bf16 tolerance of eager (mode NONE: bitwise), which
kind ran (verify steps FULL wherever the mode has FULL graphs; mixed batches above the
largest piecewise size eager), and at the end the live KV caches of both models agree,
so padded rows never wrote a live slot. The tiny preset keeps the whole file well under
a minute on an H200 (one compile per piecewise mode).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter

import pytest
import torch

from graphguard.config import Mode
from graphguard.sizes import capture_sizes
from graphguard_ref.llama import LlamaConfig, LlamaDecodeModel
from graphguard_ref.serving_loop import EngineScheduler, build_dispatcher, release

K = 2
Q = 1 + K
MAX_BATCH = 16
CONTEXT = 256
MAX_TOKENS = 64
FULL_SIZES = capture_sizes(MAX_BATCH * Q, multiple_of=Q)  # 3, 6, 12, 24, 48
PW_SIZES = capture_sizes(40)  # 1, 2, 4, 8, 16, 24, 32, 40: 41..64 tokens run eagerly
STEPS = 1000
LIVE_COUNTS = (16, 1, 12, 2, 8, 3, 16, 4, 6, 1)

EXPECTED_KINDS = {
    "none": {"none"},
    "piecewise": {"piecewise", "none"},
    "full": {"full", "none"},
    "full_and_piecewise": {"full", "piecewise", "none"},
}


def live_schedule(steps: int, seed: int) -> list[int]:
    """Live request counts: segments of 8..40 steps, cycling big and small counts."""
    rng = random.Random(seed)
    out: list[int] = []
    i = 0
    while len(out) < steps:
        out += [LIVE_COUNTS[i % len(LIVE_COUNTS)]] * rng.randint(8, 40)
        i += 1
    return out[:steps]


def _cfg() -> LlamaConfig:
    return LlamaConfig.preset("tiny", max_batch=MAX_BATCH, max_context=CONTEXT)


@pytest.fixture(scope="module")
def models():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    served = LlamaDecodeModel.random(_cfg(), device="cuda", dtype=torch.bfloat16, seed=0)
    reference = LlamaDecodeModel.random(_cfg(), device="cuda", dtype=torch.bfloat16, seed=0)
    for a, b in zip(served.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    return served, reference


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _drops(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive (previous, next) padded sizes where the size shrank at least 4x."""
    return [(a, b) for a, b in itertools.pairwise(sizes) if b * 4 <= a]


@pytest.mark.parametrize("mode", list(EXPECTED_KINDS))
@torch.inference_mode()
def test_every_mode_equals_eager_over_1000_prefill_decode_and_verify_steps(models, mode):
    served, reference = models
    m = Mode.parse(mode)
    dev = served.device
    d = build_dispatcher(
        served,
        mode,
        max_tokens=MAX_TOKENS,
        query_len=Q,
        full_sizes=FULL_SIZES if m.has_full else None,
        piecewise_sizes=PW_SIZES if m.has_piecewise else None,
        name=f"modes.{mode}",
    )
    print()
    print(d.plan.table())
    t0 = time.perf_counter()
    reports = d.capture()
    capture_s = time.perf_counter() - t0
    try:
        for kind, report in reports.items():
            print(f"{mode}/{kind}: {report.summary()}")
            assert report.failed == [], report.table()
        served.reset_cache()
        reference.reset_cache()
        sched = EngineScheduler(
            max_batch=MAX_BATCH,
            max_context=CONTEXT,
            max_tokens=MAX_TOKENS,
            vocab=served.config.vocab_size,
            spec_tokens=K,
            prompt_len=12,
            chunk=16,
            max_new=24,
            seed=1,
        )
        rng = random.Random(2)
        seen: Counter[tuple[str, str]] = Counter()
        bitwise: Counter[str] = Counter()
        padded: dict[str, list[int]] = {"full": [], "piecewise": []}
        worst_rel, agree, total, steps = 0.0, 0, 0, 0
        t0 = time.perf_counter()
        for target in live_schedule(STEPS, seed=3):
            sched.set_live(target)
            batch = sched.next_batch(dev, spec=rng.random() < 0.6, prefill=rng.random() < 0.5)
            assert batch is not None
            decision = d.plan.resolve(batch.key)
            got = d(batch.key, *batch.inputs).clone()
            ref = reference.mixed_step(*batch.inputs)
            assert got.shape == ref.shape == (batch.num_tokens, served.config.vocab_size)
            diff = (got.float() - ref.float()).abs()
            scale = float(ref.float().abs().max())
            # bf16: a few ulps of the step's largest logit, plus a relative term.
            tol = 0.05 * scale + 0.05 * ref.float().abs()
            bad = int((diff > tol).sum())
            assert bad == 0, (
                f"step {steps} ({batch.label}, {batch.num_tokens} tokens, ran "
                f"{decision.kind} at {decision.size}): {bad} logits off, max diff "
                f"{float(diff.max()):.3g} vs scale {scale:.3g}"
            )
            same = torch.equal(got, ref)
            if mode == "none":
                assert same, f"step {steps}: mode none must be bitwise equal to eager"
            bitwise[decision.kind] += int(same)
            worst_rel = max(worst_rel, float(diff.max()) / max(scale, 1e-6))
            greedy = ref.argmax(-1)
            agree += int((got.argmax(-1) == greedy).sum())
            total += batch.num_tokens
            seen[(batch.label, decision.kind)] += 1
            if decision.kind in padded:
                padded[decision.kind].append(decision.size)
            if batch.label == "verify" and m.has_full:
                assert decision.kind == "full", f"verify step of {batch.num_tokens} tokens"
            if batch.label == "mixed" and batch.num_tokens > PW_SIZES[-1] and m.has_piecewise:
                assert decision.kind == "none"
            sched.commit(batch, greedy.tolist())
            steps += 1
        loop_s = time.perf_counter() - t0
        kinds = {k for _, k in seen}
        labels = {label for label, _ in seen}
        print(
            f"{mode}: {steps} steps in {loop_s:.1f} s (capture {capture_s:.1f} s); "
            f"(batch, ran) counts {dict(sorted(seen.items()))}"
        )
        print(
            f"{mode}: worst |diff| / max|logit| {worst_rel:.2e}, argmax agreement "
            f"{100 * agree / total:.2f}% of {total} tokens, bitwise-equal steps by kind "
            f"{dict(bitwise)}; spec {sched.stats.to_dict()}"
        )
        for kind, sizes in padded.items():
            if sizes:
                print(
                    f"{mode}: {kind} sizes used {sorted(set(sizes))}, "
                    f"{len(_drops(sizes))} drops >= 4x (e.g. {_drops(sizes)[:5]})"
                )
        assert steps >= 1000
        assert labels == {"decode", "verify", "mixed"}, seen
        assert kinds == EXPECTED_KINDS[mode], seen
        assert sched.stats.drafted > 0 and len(sched.finished) > 20
        assert agree / total >= 0.9
        for kind in kinds & {"full", "piecewise"}:
            assert len(set(padded[kind])) >= 4, padded[kind]
            assert _drops(padded[kind]), f"no {kind} transition from a large to a small size"
        for n, (a, b) in enumerate(
            zip(served.layers, reference.layers)  # type: ignore[arg-type]
        ):
            for name in ("k_cache", "v_cache"):
                live_a = getattr(a, name)[:MAX_BATCH].float()
                live_b = getattr(b, name)[:MAX_BATCH].float()
                err = float((live_a - live_b).abs().max())
                assert err <= 0.05 * float(live_b.abs().max()) + 1e-3, (
                    f"layer {n} {name}: live cache differs by {err:.3g}"
                )
        if m.has_piecewise:
            assert d.piecewise is not None
            assert getattr(d.piecewise, "compile_count", 1) == 1, "a token count recompiled"
    finally:
        release(d)
