"""The ``graphguard`` command: ``demo`` (decode or engine loop, graphs vs eager) and ``doctor``."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _doctor() -> int:
    import graphguard

    print(
        f"graphguard {graphguard.__version__}, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )
    if not torch.cuda.is_available():
        print("CUDA: not available (CUDA graphs need a GPU; mode='none' runs eagerly)")
        return 0
    print(
        f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} device(s), "
        f"{torch.cuda.get_device_name()}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graphguard", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="decode loop with changing batch sizes: graphs vs eager")
    demo.add_argument("--preset", default=None, help="model preset: llama-1b (GPU default), tiny")
    demo.add_argument("--max-batch", type=int, default=256, help="live sequence slots")
    demo.add_argument("--context", type=int, default=1024, help="max context per sequence")
    demo.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="capture sizes, e.g. '1,2,4,8' (default: the ladder up to max-batch)",
    )
    demo.add_argument("--steps", type=int, default=400)
    demo.add_argument(
        "--phases",
        type=_sizes,
        default=None,
        help="batch sizes the loop moves through (default 8,1,37,256)",
    )
    demo.add_argument(
        "--mode",
        default="full",
        choices=["none", "full", "piecewise", "full_and_piecewise"],
        help="graph mode. full/none without --spec-tokens or --engine run the decode loop "
        "(decode_step, one GraphRunner); piecewise, full_and_piecewise, --spec-tokens K or "
        "--engine run the engine loop (mixed_step through a Dispatcher: uniform decode / "
        "verify steps FULL, steps with prefill chunks PIECEWISE)",
    )
    demo.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decode: verify K draft tokens per request per step (q = 1 + K)",
    )
    demo.add_argument(
        "--engine", action="store_true", help="run the engine loop even in mode full/none"
    )
    demo.add_argument(
        "--prompt-len", type=int, default=16, help="engine loop: prompts of 1..2x this many tokens"
    )
    demo.add_argument(
        "--chunk", type=int, default=32, help="engine loop: prefill tokens per request per step"
    )
    demo.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="engine loop: token budget per step (default max_batch * (1 + K) + chunk)",
    )
    demo.add_argument(
        "--full-mixed",
        action="store_true",
        help="engine loop, mode full: mixed steps replay the FULL graphs too",
    )
    demo.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism over N ranks (under torchrun, or spawns N processes itself)",
    )
    demo.add_argument("--sanitize", action="store_true", help="turn the sanitizer on")
    demo.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    demo.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("doctor", help="print versions and the CUDA device")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.cmd == "doctor":
        return _doctor()
    from graphguard.demo import DEFAULT_PHASES, run_demo

    if args.tp:
        if args.sanitize or args.spec_tokens or args.engine:
            ap.error("--tp runs the decode loop only (no --sanitize, --spec-tokens, --engine)")
        from graphguard.models.tp import run_tp_demo

        run_tp_demo(
            args.tp,
            preset=args.preset,
            max_batch=args.max_batch,
            max_context=args.context,
            sizes=args.sizes,
            steps=args.steps,
            phases=args.phases,
            mode=args.mode,
            json_path=args.json,
        )
        return 0
    run_demo(
        preset=args.preset,
        max_batch=args.max_batch,
        max_context=args.context,
        sizes=args.sizes,
        steps=args.steps,
        phases=args.phases or DEFAULT_PHASES,
        mode=args.mode,
        sanitize=args.sanitize,
        json_path=args.json,
        spec_tokens=args.spec_tokens,
        engine=args.engine,
        prompt_len=args.prompt_len,
        chunk=args.chunk,
        max_tokens=args.max_tokens,
        full_mixed=args.full_mixed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
