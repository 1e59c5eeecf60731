#!/usr/bin/env bash
# Everything that can only be true on a GPU. Run on the GPU machine from the repo root
# (PYTHONPATH=src:ref/src, no install needed). Logs and results land in ${OUT:-out}/r/ and are
# packed into ${OUT}/results.tgz; copy the ones to keep into bench/results/.
#   bash scripts/gpu_suite.sh tests    # tests/gpu + the stream/arena CUDA tests
#   bash scripts/gpu_suite.sh bench    # dispatch, decode, pool, HF, sanitizer benchmarks
#   bash scripts/gpu_suite.sh engine   # modes benchmark, decode and engine demos
#   bash scripts/gpu_suite.sh tp       # tensor parallel on every visible GPU (needs >= 2)
#   bash scripts/gpu_suite.sh all      # all of them (or a list: tests,bench,tp); with 2+
#                                      # GPUs the tests run on the last GPU while the
#                                      # benchmarks time on GPU 0
set -uo pipefail
OUT=${OUT:-out}
R="$OUT/r"
mkdir -p "$R"
export PYTHONPATH=src:ref/src PYTHONUNBUFFERED=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, torch.version.cuda, "transformers", transformers.__version__)'
  env | grep -E '^(CUDA_|NCCL_|PYTORCH_|TORCH_)' | sort; } > "$R/machine.txt" 2>&1
cat "$R/machine.txt"
what=${1:-all}
# Parts: tests, bench (= decode,hf,pool,dispatch,sanitizer), engine (= modes,demo,demo-engine), tp.
what=${what//bench/decode,hf,pool,dispatch,sanitizer}
what=${what//engine/modes,demo,demo-engine}
has() { [[ $what == all || ",$what," == *",$1,"* ]]; }
DECODE_ARGS=${DECODE_ARGS:-}  # e.g. --skip-compile
status=0
step() {  # step NAME TIMEOUT CMD...: run, log to $R/NAME.log, print the tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1 || { echo "!! $name exited $?"; status=1; }
  echo "== $name ($((SECONDS - t0)) s)"; tail -n "${TAIL:-6}" "$R/$name.log"
}
run_tests() {
  step gpu-tests 540 python3 -m pytest tests/gpu tests/test_streams.py tests/test_workspace.py \
    -q -rfEs -p no:cacheprovider --continue-on-collection-errors
}
if has tests && [[ $what != tests && $NGPU -ge 2 ]]; then
  # Tests on the last GPU, in the background; benchmarks alone on GPU 0.
  ( export CUDA_VISIBLE_DEVICES=$((NGPU - 1)); TAIL=25 run_tests > "$R/gpu-tests.tail" 2>&1; exit $status ) &
  tests_pid=$!
elif has tests; then
  TAIL=25 run_tests
fi
export CUDA_VISIBLE_DEVICES=0
# Compile times are a user's first run: every bench that compiles gets empty Inductor and
# Triton caches (a warm machine would otherwise reuse an earlier run's kernels).
cold() { echo env TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)"; }
# shellcheck disable=SC2046,SC2086
has decode && TAIL=30 step decode 300 $(cold) python3 bench/bench_decode.py --out "$R" $DECODE_ARGS
has hf && TAIL=12 step hf 420 python3 bench/bench_hf.py --out "$R/hf.json" --cold-cache
has pool && TAIL=20 step pool 120 python3 bench/bench_pool.py --out "$R/pool.json"
has dispatch && step dispatch 60 python3 bench/bench_dispatch.py --out "$R/dispatch.json"
has sanitizer && step sanitizer 60 python3 bench/bench_sanitizer.py --out "$R/sanitizer.json"
has modes && TAIL=25 step modes 240 python3 bench/bench_modes.py --out "$R"
has demo && TAIL=12 step demo 200 python3 -m graphguard_ref.cli --steps 300
has demo-engine && TAIL=25 step demo-engine 240 python3 -m graphguard_ref.cli \
  --mode full_and_piecewise --spec-tokens 2 --max-batch 64 --steps 300
unset CUDA_VISIBLE_DEVICES
if [[ -n ${tests_pid:-} ]]; then
  wait "$tests_pid" || status=1
  cat "$R/gpu-tests.tail"
fi
if has tp && [[ $NGPU -ge 2 ]]; then
  TAIL=20 step tp-tests 240 python3 -m pytest tests/gpu/test_distributed_gpu.py -q -rfEs -p no:cacheprovider
  OUT="$R" TAIL=15 step tp 300 bash scripts/run_tp.sh "$NGPU"
fi
tar -czf "$OUT/results.tgz" -C "$R" .
exit $status
