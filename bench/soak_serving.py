"""Serving-time calls under concurrency: a serving thread and a controller thread, soaked.

The serving thread runs random-size steps on a lazy runner (sizes captured on first use,
batches above the ladder eager): ``capture_for(n)`` first, outside any application lock,
so a lazy capture can be open while the controller acts; then, under the application's
step lock, the call and an eager reference with the weights in force, compared. The
controller thread at random calls ``release()`` then ``capture()``, ``update_weights``
(new random weights, in place), ``check_weights()``, ``stats()`` and ``verify()``; the
device-wide ones (release, capture, update, verify) under the same step lock, as an engine
runs them between steps, so they meet the serving thread's lazy captures but never its
replays. graphguard's rule (docs/serving.md) is what is exercised: a call that meets an
open capture waits for it; nothing device-wide lands inside one.

Counted: every serving result against eager (``torch.testing.assert_close``), every
controller call done or refused (a ``GraphGuardError`` with its message kept) or failed
otherwise, and any CUDA error. ``--sanitize`` runs the same with the sanitizer on.

    python3 bench/soak_serving.py --rounds 2000 --out $OUT/soak.json [--sanitize]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import graphguard as gg
from graphguard.errors import GraphGuardError

SIZES = [1, 2, 4, 8, 16, 32]


def build(sanitize: bool) -> tuple[torch.nn.Module, gg.GraphRunner]:
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        .cuda()
        .eval()
    )
    runner = gg.GraphRunner(
        model,
        (torch.randn(4, 64, device="cuda"),),
        sizes=SIZES,
        lazy=True,
        sanitize=sanitize,
        progress=False,
        name="soak",
    )
    return model, runner


def soak(rounds: int, sanitize: bool, seed: int) -> dict[str, Any]:
    model, runner = build(sanitize)
    step_lock = threading.Lock()
    done = threading.Event()
    serving: collections.Counter[str] = collections.Counter()
    control: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    refusals: dict[str, str] = {}
    failures: list[str] = []
    with torch.inference_mode():
        runner.capture()

    def serve() -> None:
        rng = random.Random(seed)
        try:
            with torch.inference_mode():
                for _ in range(rounds):
                    n = rng.choice([1, 2, 3, 5, 8, 13, 21, 32, 40])
                    x = torch.randn(n, 64, device="cuda")
                    try:
                        runner.capture_for(n)  # a lazy capture, open while the controller acts
                    except GraphGuardError as exc:
                        serving["capture_for refused"] += 1
                        refusals.setdefault("capture_for", str(exc)[:300])
                    with step_lock:
                        try:
                            out = runner(x)
                        except GraphGuardError as exc:  # released, not captured yet
                            serving["call refused"] += 1
                            refusals.setdefault("call", str(exc)[:300])
                            continue
                        ref = model(x)
                        try:
                            torch.testing.assert_close(out, ref)
                            serving["equal to eager"] += 1
                        except AssertionError as exc:
                            serving["differs from eager"] += 1
                            failures.append(f"n={n}: {str(exc)[:300]}")
        except Exception:
            failures.append("serving thread: " + traceback.format_exc()[-800:])
        finally:
            done.set()

    def act(name: str, fn: Any, locked: bool) -> None:
        try:
            if locked:
                with step_lock:
                    fn()
            else:
                fn()
            control[name]["done"] += 1
        except GraphGuardError as exc:
            control[name]["refused"] += 1
            refusals.setdefault(name, f"{type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:
            control[name]["failed"] += 1
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")

    # The controller draws from its own CUDA generator: the default one is registered with
    # every capture, and torch refuses another thread's draw from it while one is open.
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)

    def new_weights() -> None:
        sd = {
            k: torch.randn(v.shape, device=v.device, generator=gen) * 0.05
            for k, v in model.state_dict().items()
        }
        runner.update_weights(sd)

    def recapture() -> None:
        runner.release()
        with torch.inference_mode():
            runner.capture()

    def verify() -> None:
        with torch.inference_mode():
            if runner.captured_sizes:
                runner.verify()

    def control_loop() -> None:
        rng = random.Random(seed + 1)
        actions = [
            ("release+capture", recapture, True),
            ("update_weights", new_weights, True),
            ("check_weights", lambda: runner.check_weights().raise_if_moved(), False),
            ("stats", runner.stats, False),
            ("verify", verify, True),
        ]
        while not done.is_set():
            name, fn, locked = rng.choice(actions)
            act(name, fn, locked)
            time.sleep(rng.random() * 0.002)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=serve), threading.Thread(target=control_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    stats = runner.stats()
    return {
        "sanitize": sanitize,
        "rounds": rounds,
        "seconds": round(time.perf_counter() - t0, 2),
        "serving": dict(serving),
        "control": {k: dict(v) for k, v in control.items()},
        "refusals_first_seen": refusals,
        "failures": failures[:20],
        "failures_total": len(failures),
        "final_captured_sizes": list(runner.captured_sizes),
        "lazy_captures": sum(1 for s in stats.sizes if s.how == "lazily"),
        "ok": not failures and serving["differs from eager"] == 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {
        "commit": os.environ.get("GRAPHGUARD_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **soak(args.rounds, args.sanitize, args.seed),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
