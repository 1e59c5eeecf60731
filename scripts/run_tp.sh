#!/usr/bin/env bash
# Tensor-parallel graphs on N GPUs of one host: replay == eager on every rank over
# >= 500 steps with batch transitions, ms/step eager vs graphguard, JSON to ${OUT:-out}/.
#   bash scripts/run_tp.sh N [extra bench/bench_tp.py args, e.g. --steps 800]
# NCCL settings (NCCL_NVLS_ENABLE=0 and the other multicast switches) are left exactly as
# the machine sets them; the bench records every NCCL_* variable in its JSON.
set -euo pipefail
N=${1:?usage: bash scripts/run_tp.sh N [bench args]}
shift
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src:ref/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
env | grep -E '^NCCL_' | sort | tee "$OUT/tp${N}-nccl-env.txt" || true
if command -v torchrun >/dev/null 2>&1; then
  launch=(torchrun)
else
  launch=(python3 -m torch.distributed.run)
fi
"${launch[@]}" --standalone --nproc-per-node "$N" bench/bench_tp.py --out "$OUT" "$@" \
  2>&1 | tee "$OUT/tp${N}.log"
