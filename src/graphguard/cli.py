"""The ``graphguard`` command: ``demo`` (decode loop, graphs vs eager) and ``doctor``."""

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
    demo.add_argument("--mode", default="full", choices=["full", "none"])
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
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
