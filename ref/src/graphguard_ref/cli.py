"""The ``graphguard`` command: ``demo`` (decode or engine loop, graphs vs eager) and ``doctor``.

Contract: every bad flag or flag combination is a one-line argparse error (exit code 2)
raised before any model is built: value checks in the ``type=`` functions, then
:func:`validate_demo_args` for what depends on several flags.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from graphguard.config import Mode
from graphguard_ref.demo.common import DEFAULT_PHASES
from graphguard_ref.demo.decode import run_demo, uses_engine_loop
from graphguard_ref.demo.tp import run_tp_demo
from graphguard_ref.llama import PRESETS
from graphguard_ref.tp import shard_config

MODES = [m.value for m in Mode]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An ``int >= 1`` (argparse ``type=``)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An ``int >= 0`` (argparse ``type=``)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """``'1,2,4'`` (or space-separated): a non-empty list of integers >= 1."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("expected a list of integers >= 1 like '1,2,4', got ''")
    values = [_int(p) for p in parts]
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(
            f"every value must be an integer >= 1, got {', '.join(map(str, bad))} in {text!r}"
        )
    return values


def _check_writable(path: Path) -> str | None:
    """Why ``path`` cannot be written (creating its folder if needed), or None."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if not existed:
        path.unlink()
    return None


def validate_demo_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need several flags; each failure is ``ap.error`` (exit 2), before any work."""
    engine = uses_engine_loop(args.mode, args.spec_tokens, args.engine)
    q = 1 + args.spec_tokens
    engine_only = (
        ("--prompt-len", args.prompt_len is not None),
        ("--chunk", args.chunk is not None),
        ("--max-tokens", args.max_tokens is not None),
        ("--full-mixed", args.full_mixed),
    )
    given = [flag for flag, on in engine_only if on]
    if args.tp is not None:
        bad = [f for f, on in (("--sanitize", args.sanitize), ("--engine", args.engine)) if on]
        bad += ["--spec-tokens"] if args.spec_tokens else []
        if bad or given:
            ap.error(f"--tp runs the decode loop only; drop {', '.join(bad + given)}")
        if Mode.parse(args.mode).has_piecewise:
            ap.error(f"--tp runs the decode loop in mode full or none, not {args.mode}")
        cuda = torch.cuda.is_available()
        if cuda and torch.cuda.device_count() < args.tp:
            ap.error(
                f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}"
            )
        preset = args.preset or ("llama-1b" if cuda else "tiny")
        try:
            shard_config(PRESETS[preset], args.tp)
        except ValueError as exc:
            ap.error(f"--tp {args.tp} with preset {preset}: {exc}")
    elif not engine and given:
        ap.error(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the engine loop "
            "only; add --engine, --spec-tokens K or --mode piecewise/full_and_piecewise"
        )
    if engine and args.sanitize:
        ap.error("--sanitize applies to the decode loop only (mode full or none)")
    if args.full_mixed and args.mode != "full":
        ap.error(f"--full-mixed applies to mode full only, not {args.mode}")
    if engine:
        if args.context < q + 2:
            ap.error(
                f"--context {args.context} is too small for {q} tokens per request per "
                f"step (--spec-tokens {args.spec_tokens}): need >= {q + 2}"
            )
        if args.max_tokens is not None and args.max_tokens < args.max_batch * q:
            ap.error(
                f"--max-tokens {args.max_tokens} < --max-batch * (1 + --spec-tokens) = "
                f"{args.max_batch * q}: a step of every request decoding would not fit"
            )
        whole = [s for s in args.sizes or [] if s % q == 0 and s <= args.max_batch * q]
        if args.sizes and Mode.parse(args.mode).has_full and not whole:
            ap.error(
                f"--sizes {','.join(map(str, args.sizes))}: mode {args.mode} needs a size "
                f"that is a multiple of 1 + --spec-tokens = {q} and <= {args.max_batch * q}"
            )
    if args.json is not None:
        why = _check_writable(args.json)
        if why is not None:
            ap.error(f"--json {args.json}: cannot write there ({why})")


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


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``graphguard`` parser and its ``demo`` subparser."""
    ap = argparse.ArgumentParser(prog="graphguard", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="decode loop with changing batch sizes: graphs vs eager")
    add = demo.add_argument
    add("--preset", default=None, choices=sorted(PRESETS), help="model (GPU default llama-1b)")
    add("--max-batch", type=positive_int, default=256, help="live sequence slots")
    add("--context", type=positive_int, default=1024, help="max context per sequence")
    add(
        "--sizes",
        type=size_list,
        default=None,
        help="capture sizes, e.g. '1,2,4,8' (default: the ladder up to max-batch)",
    )
    add("--steps", type=positive_int, default=400)
    add(
        "--phases",
        type=size_list,
        default=None,
        help="batch sizes the loop moves through (default 8,1,37,256)",
    )
    add(
        "--mode",
        default="full",
        choices=MODES,
        help="graph mode. full/none without --spec-tokens or --engine run the decode loop "
        "(decode_step, one GraphRunner); piecewise, full_and_piecewise, --spec-tokens K or "
        "--engine run the engine loop (mixed_step through a Dispatcher: uniform decode / "
        "verify steps FULL, steps with prefill chunks PIECEWISE)",
    )
    add(
        "--spec-tokens",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="speculative decode: verify K draft tokens per request per step (q = 1 + K)",
    )
    add("--engine", action="store_true", help="run the engine loop even in mode full/none")
    add(
        "--prompt-len",
        type=positive_int,
        default=None,
        help="engine loop: prompts of 1..2x this many tokens (default 16)",
    )
    add(
        "--chunk",
        type=positive_int,
        default=None,
        help="engine loop: prefill tokens per request per step (default 32)",
    )
    add(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="engine loop: token budget per step (default max_batch * (1 + K) + chunk)",
    )
    add(
        "--full-mixed",
        action="store_true",
        help="engine loop, mode full: mixed steps replay the FULL graphs too",
    )
    add(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="tensor parallelism over N ranks (under torchrun, or spawns N processes itself)",
    )
    add("--sanitize", action="store_true", help="turn the sanitizer on (decode loop)")
    add("--json", type=Path, default=None, help="write results as JSON here")
    add("-v", "--verbose", action="store_true")
    sub.add_parser("doctor", help="print versions and the CUDA device")
    return ap, demo


def main(argv: Sequence[str] | None = None) -> int:
    ap, demo = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.cmd == "doctor":
        return _doctor()
    validate_demo_args(demo, args)
    if args.tp is not None:
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
        prompt_len=args.prompt_len if args.prompt_len is not None else 16,
        chunk=args.chunk if args.chunk is not None else 32,
        max_tokens=args.max_tokens,
        full_mixed=args.full_mixed,
    )
    return 0


__all__ = ["build_parser", "main", "non_negative_int", "positive_int", "size_list"]

if __name__ == "__main__":
    sys.exit(main())
