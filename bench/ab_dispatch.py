"""The replay path's host cost, two versions of the library in one run (old against new).

Why: a dispatch benchmark run on two days measures two machines' moods as much as two
versions. This runs ``bench/bench_dispatch.py`` (the same script for both) in fresh
interpreters, interleaved ``old, new, old, new, ...``, with ``PYTHONPATH`` pointing at each
version's ``src`` (and ``ref/src``), and reports each variant's median over the rounds.

Usage (on the GPU machine, from the repo root; the old tree from ``git archive``)::

    git archive c876e15 src ref | tar -x -C .gpuwork/old        # here, before the call
    python3 bench/ab_dispatch.py --old .gpuwork/old --new . --rounds 4 \
        --old-commit c876e15 --new-commit $(git rev-parse --short HEAD) --out $OUT/ab.json

Writes JSON (every run, the medians, new minus old per variant) and, with matplotlib, a
PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).with_name("bench_dispatch.py")
KEYS = (
    "bare_replay_us",
    "runner_exact_us",
    "runner_padded_us",
    "runner_shrinking_us",
    "runner_zero_copy_replay_us",
    "dispatch_overhead_us",
    "dispatch_overhead_padded_us",
    "zero_copy_overhead_us",
    "naive_us",
)


def run_once(tree: Path, repeats: int) -> dict[str, float]:
    """One ``bench_dispatch.py`` run against the library in ``tree``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{tree / 'src'}{os.pathsep}{tree / 'ref' / 'src'}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "d.json"
        cmd = [sys.executable, str(BENCH), "--repeats", str(repeats), "--out", str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        data: dict[str, float] = json.loads(out.read_text())
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, default=Path("."))
    ap.add_argument("--old-commit", default="old")
    ap.add_argument("--new-commit", default="new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for side, tree in (("old", args.old), ("new", args.new)):
            runs[side].append(run_once(tree.resolve(), args.repeats))
    medians = {
        side: {k: round(statistics.median(r[k] for r in rs), 3) for k in KEYS}
        for side, rs in runs.items()
    }
    first = runs["new"][0]
    out = {
        "gpu": first.get("gpu"),
        "torch": first.get("torch"),
        "date": time.strftime("%Y-%m-%d"),
        "what": "bench/bench_dispatch.py run interleaved old, new, old, new in one device "
        "call (host-side us per call; each run a median of --repeats blocks)",
        "commits": {"old": args.old_commit, "new": args.new_commit},
        "commit": args.new_commit,
        "rounds": args.rounds,
        "runs": runs,
        "median_of_runs": medians,
        "new_minus_old_us": {k: round(medians["new"][k] - medians["old"][k], 3) for k in KEYS},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"median_of_runs": medians, "new_minus_old_us": out["new_minus_old_us"]}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [k for k in KEYS if k != "naive_us"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    xs = range(len(shown))
    for i, side in enumerate(("old", "new")):
        ax.bar(
            [x + (i - 0.5) * width for x in xs],
            [medians[side][k] for k in shown],
            width,
            label=f"{side} ({out['commits'][side]})",
        )
        for r in runs[side]:  # every run, so the spread shows
            ax.scatter([x + (i - 0.5) * width for x in xs], [r[k] for k in shown], s=6, c="k")
    ax.set_xticks(list(xs), [k.removesuffix("_us") for k in shown], rotation=30, ha="right")
    ax.set_ylabel("host µs per call (median of runs; dots: each run)")
    ax.set_title(f"replay path, old vs new, {out['gpu']}, {out['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
