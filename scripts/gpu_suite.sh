#!/usr/bin/env bash
# Everything that can only be true on a GPU. Run on the GPU machine from the repo root
# (PYTHONPATH=src, no install needed); results land in ${OUT:-out}/, copy the ones to
# keep into bench/results/. Each part writes at most 8 files (the device tool's limit).
#   bash scripts/gpu_suite.sh tests   # tests/gpu + the stream/arena CUDA tests
#   bash scripts/gpu_suite.sh bench   # dispatch, sanitizer and decode benchmarks, demo
#   bash scripts/gpu_suite.sh engine  # modes benchmark, engine demo, TP on this GPU
#   bash scripts/gpu_suite.sh all     # all three
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  env | grep -E '^(CUDA_|NCCL_|PYTORCH_)' | sort; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
status=0
what=${1:-all}
if [[ $what == all || $what == tests ]]; then
  timeout 420 python3 -m pytest tests/gpu tests/test_streams.py tests/test_workspace.py -q -rA -s \
    -p no:cacheprovider --continue-on-collection-errors > "$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -40
fi
if [[ $what == all || $what == bench ]]; then
  python3 bench/bench_dispatch.py --out "$OUT/dispatch.json" > /dev/null || status=1
  timeout 200 python3 bench/bench_sanitizer.py --out "$OUT/sanitizer.json" | tail -12 || status=1
  timeout 420 python3 bench/bench_decode.py --out "$OUT" 2>&1 | tail -32 || status=1
  timeout 200 python3 -m graphguard_ref.cli demo --steps 300 > "$OUT/demo.log" 2>&1 || status=1
  tail -12 "$OUT/demo.log"
fi
if [[ $what == all || $what == engine ]]; then
  timeout 240 python3 bench/bench_modes.py --out "$OUT/modes.json" 2>&1 | tail -25 || status=1
  timeout 240 python3 -m graphguard_ref.cli demo --mode full_and_piecewise --spec-tokens 2 \
    --max-batch 64 --steps 300 > "$OUT/demo_engine.log" 2>&1 || status=1
  tail -25 "$OUT/demo_engine.log"
  OUT="$OUT" timeout 200 bash scripts/run_tp.sh 1 > /dev/null 2>&1 || status=1
  tail -15 "$OUT/tp1.log"
fi
exit $status
