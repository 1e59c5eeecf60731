#!/usr/bin/env bash
# Everything that can only be true on a GPU, in one call: the GPU tests, then the
# benchmarks and the demo. Run on the GPU machine from the repo root (PYTHONPATH=src,
# no install needed). Results land in ${OUT:-out}/; copy the ones to keep into bench/results/.
#   bash scripts/gpu_suite.sh [all|tests|bench]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' | tee -a "$OUT/gpu.txt"
status=0
what=${1:-all}
if [[ $what == all || $what == tests ]]; then
  timeout 300 python3 -m pytest tests/gpu tests/test_streams.py tests/test_workspace.py -q -rA -s \
    -p no:cacheprovider --continue-on-collection-errors > "$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -80
fi
if [[ $what == all || $what == bench ]]; then
  python3 bench/bench_dispatch.py --out "$OUT/dispatch.json" > /dev/null || status=1
  [[ -f bench/bench_sanitizer.py ]] && { timeout 200 python3 bench/bench_sanitizer.py --out "$OUT/sanitizer.json" || status=1; }
  timeout 420 python3 bench/bench_decode.py --out "$OUT" 2>&1 | tail -30 || status=1
  timeout 200 python3 -m graphguard.cli demo --steps 300 --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1 || status=1
  tail -25 "$OUT/demo.log"
fi
exit $status
