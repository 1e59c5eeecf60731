"""The ``graphguard-demo`` command: the reference app's decode, engine and TP loops.

Contract: every bad flag or flag combination is a one-line argparse error (exit code 2)
raised before any model is built: value checks in the ``type=`` functions, then
:func:`validate_demo_args` for what depends on several flags, the machine (a CPU runs
the tiny preset) or memory (the model and its KV cache must fit). Nothing a user passes
is silently ignored or capped. The library's own command is ``graphguard`` (``graphguard
doctor``); this one belongs to the reference application, its own distribution.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

import graphguard
from graphguard.config import Mode
from graphguard.errors import ConfigError
from graphguard_ref.demo.common import DEFAULT_PHASES
from graphguard_ref.demo.decode import run_demo, uses_engine_loop
from graphguard_ref.demo.tp import run_tp_demo
from graphguard_ref.llama import PRESETS, LlamaConfig
from graphguard_ref.serving_loop import default_max_tokens
from graphguard_ref.tp import shard_config

PROG = "graphguard-demo"
MODES = [m.value for m in Mode]
MAX_STEPS = 100_000
"""More steps than this is a typo (``10**22``), not a demo: it would never print."""
GPU_DEFAULTS = {"max_batch": 256, "context": 1024, "steps": 400, "preset": "llama-1b"}
CPU_DEFAULTS = {"max_batch": 8, "context": 64, "steps": 48, "preset": "tiny"}
CPU_PHASES = (8, 1, 5, 3)
MEMORY_HEADROOM = 0.9
"""Fraction of the free memory the model and its KV cache may take."""


def _int(text: str) -> int:
    try:
        return int(text.strip())
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


def step_count(text: str) -> int:
    """``--steps``: an int in ``1..MAX_STEPS``."""
    value = positive_int(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_STEPS}, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """``'1,2,4'``: comma-separated integers >= 1, each once (order free)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 like '1,2,4', got {text!r} (an empty item)"
        )
    values = [_int(p) for p in parts]
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(
            f"every value must be an integer >= 1, got {', '.join(map(str, bad))} in {text!r}"
        )
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(str, repeated))} given more than once in {text!r}; list each once"
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


def free_memory_bytes(cuda: bool) -> int | None:
    """Free memory where the model will live (the GPU, else the host), or None if unknown."""
    if cuda:
        return int(torch.cuda.mem_get_info()[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not Linux: no cheap answer
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def resolve_defaults(args: argparse.Namespace, cuda: bool) -> None:
    """Fill the flags left unset with this machine's defaults (GPU: llama-1b, CPU: tiny)."""
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    for name in ("max_batch", "context", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    args.preset_given = args.preset is not None
    args.mode_given = args.mode is not None
    if args.mode is None:
        args.mode = "full"
    if args.preset is None:
        args.preset = defaults["preset"]
    if args.phases is None:  # the defaults are shown capped; a user's phases never are
        base = DEFAULT_PHASES if cuda else CPU_PHASES
        args.phases = list(dict.fromkeys(min(p, args.max_batch) for p in base))


def validate_demo_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need several flags; each failure is ``ap.error`` (exit 2), before any work.

    Expects :func:`resolve_defaults` to have run.
    """
    cuda = torch.cuda.is_available()
    engine = uses_engine_loop(args.mode, args.spec_tokens, args.engine)
    q = 1 + args.spec_tokens
    engine_only = (
        ("--prompt-len", args.prompt_len is not None),
        ("--chunk", args.chunk is not None),
        ("--max-tokens", args.max_tokens is not None),
        ("--full-mixed", args.full_mixed),
    )
    given = [flag for flag, on in engine_only if on]
    if not cuda and args.preset != "tiny":
        ap.error(
            f"--preset {args.preset} needs a CUDA GPU; on a CPU the demo runs the 'tiny' "
            "preset under the RecordingBackend (drop --preset)"
        )
    if args.tp is not None:
        bad = [f for f, on in (("--sanitize", args.sanitize), ("--engine", args.engine)) if on]
        bad += ["--spec-tokens"] if args.spec_tokens else []
        if bad or given:
            ap.error(f"--tp runs the decode loop only; drop {', '.join(bad + given)}")
        if Mode.parse(args.mode).has_piecewise:
            ap.error(f"--tp runs the decode loop in mode full or none, not {args.mode}")
        if not cuda and args.mode_given and args.mode != "none":
            ap.error(
                f"--tp on a CPU runs eagerly (mode none): graphs of collectives need GPUs; "
                f"drop --mode {args.mode}"
            )
        if cuda and torch.cuda.device_count() < args.tp:
            ap.error(
                f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}"
            )
        try:
            shard_config(PRESETS[args.preset], args.tp)
        except ValueError as exc:
            ap.error(f"--tp {args.tp} with preset {args.preset}: {exc}")
    elif not engine and given:
        ap.error(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the engine loop "
            "only; add --engine, --spec-tokens K or --mode piecewise/full_and_piecewise"
        )
    if engine and args.sanitize:
        ap.error("--sanitize applies to the decode loop only (mode full or none)")
    if args.full_mixed and args.mode != "full":
        ap.error(f"--full-mixed applies to mode full only, not {args.mode}")
    too_many = [p for p in args.phases if p > args.max_batch]
    if too_many:
        ap.error(
            f"--phases {','.join(map(str, args.phases))}: {', '.join(map(str, too_many))} "
            f"> --max-batch {args.max_batch} (a phase is a live batch size); raise "
            "--max-batch or lower the phase"
        )
    if engine:
        _validate_engine(ap, args, q)
    elif args.sizes:
        too_big = [s for s in args.sizes if s > args.max_batch]
        if too_big:
            ap.error(
                f"--sizes {','.join(map(str, args.sizes))}: {', '.join(map(str, too_big))} > "
                f"--max-batch {args.max_batch}; a decode batch has at most max-batch rows, so "
                "that graph could never replay"
            )
    _validate_memory(ap, args, cuda)
    if args.json is not None:
        why = _check_writable(args.json)
        if why is not None:
            ap.error(f"--json {args.json}: cannot write there ({why})")


def _validate_engine(ap: argparse.ArgumentParser, args: argparse.Namespace, q: int) -> None:
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
    budget = args.max_tokens or default_max_tokens(
        args.max_batch, args.spec_tokens, args.chunk or 32
    )
    if budget > args.max_batch * args.context:
        ap.error(
            f"--max-tokens {budget} > --max-batch * --context = {args.max_batch * args.context}: "
            "a step cannot hold more tokens than the KV cache"
        )
    longest = args.context - q - 1
    if args.prompt_len is not None and 2 * args.prompt_len > longest:
        ap.error(
            f"--prompt-len {args.prompt_len}: prompts run to 2 x {args.prompt_len} tokens, more "
            f"than --context {args.context} leaves ({longest}); lower it or raise --context"
        )
    if args.sizes:
        too_big = [s for s in args.sizes if s > budget]
        if too_big:
            ap.error(
                f"--sizes {','.join(map(str, args.sizes))}: {', '.join(map(str, too_big))} > "
                f"the step's token budget {budget} (--max-tokens); no step has that many tokens"
            )
        whole = [s for s in args.sizes if s % q == 0 and s <= args.max_batch * q]
        if Mode.parse(args.mode).has_full and not whole:
            ap.error(
                f"--sizes {','.join(map(str, args.sizes))}: mode {args.mode} needs a size "
                f"that is a multiple of 1 + --spec-tokens = {q} and <= {args.max_batch * q}"
            )


def _validate_memory(ap: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """The weights and the KV cache must fit in free memory (per rank with --tp)."""
    try:
        cfg = LlamaConfig.preset(args.preset, max_batch=args.max_batch, max_context=args.context)
    except ConfigError as exc:
        ap.error(
            f"--preset {args.preset} --max-batch {args.max_batch} --context {args.context}: {exc}"
        )
    itemsize = 2 if cuda else 4  # bfloat16 on a GPU, float32 on a CPU
    ranks = args.tp or 1
    need = (cfg.num_params * itemsize + cfg.kv_cache_bytes(itemsize)) / ranks
    free = free_memory_bytes(cuda)
    if free is not None and need > MEMORY_HEADROOM * free:
        where = "GPU" if cuda else "host"
        ap.error(
            f"--max-batch {args.max_batch} --context {args.context}: {args.preset} needs "
            f"{_gib(need)} (weights and KV cache{' per rank' if ranks > 1 else ''}), the "
            f"{where} has {_gib(free)} free; lower --max-batch or --context"
        )


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``graphguard-demo`` parser."""
    ap = _Parser(
        prog=PROG,
        description=(
            "graphguard's reference app: a Llama-style model decoding while sequences join "
            "and finish, every step checked against eager. On a GPU it captures the ladder "
            "and times graphs against eager; on a CPU it runs the capture lifecycle under "
            "the RecordingBackend and shows the locked-arena error."
        ),
        epilog="The library's own command is `graphguard doctor`.",
    )
    add = ap.add_argument
    add(
        "--version",
        action="version",
        version=f"{PROG} (graphguard-ref) with graphguard {graphguard.__version__}, "
        f"torch {torch.__version__}",
    )
    add(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model (default: llama-1b on a GPU, tiny on a CPU; a CPU runs tiny only)",
    )
    add("--max-batch", type=positive_int, default=None, help="live sequence slots (GPU 256, CPU 8)")
    add(
        "--context",
        type=positive_int,
        default=None,
        help="max context per sequence (GPU 1024, CPU 64)",
    )
    add(
        "--sizes",
        type=size_list,
        default=None,
        help="capture sizes, e.g. 1,2,4,8, each <= --max-batch (default: the ladder up to it)",
    )
    add(
        "--steps",
        type=step_count,
        default=None,
        help=f"decode steps, <= {MAX_STEPS} (GPU 400, CPU 48)",
    )
    add(
        "--phases",
        type=size_list,
        default=None,
        help="batch sizes the loop moves through, each <= --max-batch (default 8,1,37,256 "
        "capped at --max-batch; CPU 8,1,5,3)",
    )
    add(
        "--mode",
        default=None,
        choices=MODES,
        help="graph mode (default full). full/none without --spec-tokens or --engine run the "
        "decode loop (decode_step, one GraphRunner); piecewise, full_and_piecewise, "
        "--spec-tokens K or --engine run the engine loop (mixed_step through a Dispatcher: "
        "uniform decode / verify steps FULL, steps with prefill chunks PIECEWISE)",
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
    add("-v", "--verbose", action="store_true", help="log graphguard's INFO lines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate (exit 2 on any bad flag, before any model), run the chosen loop."""
    ap = build_parser()
    args = ap.parse_args(argv)
    resolve_defaults(args, torch.cuda.is_available())
    validate_demo_args(ap, args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
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
        phases=args.phases,
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


__all__ = [
    "build_parser",
    "main",
    "non_negative_int",
    "positive_int",
    "resolve_defaults",
    "size_list",
    "step_count",
    "validate_demo_args",
]

if __name__ == "__main__":
    sys.exit(main())
