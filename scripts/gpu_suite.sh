#!/usr/bin/env bash
# Everything that can only be true on a GPU. Run on the GPU machine from the repo root
# (PYTHONPATH=src:ref/src, no install needed). Logs and results land in ${OUT:-out}/r/ and are
# packed into ${OUT}/results.tgz; copy the ones to keep into bench/results/.
#   bash scripts/gpu_suite.sh tests    # tests/gpu + the stream/arena CUDA tests, in two parts
#                                      # (tests-serial, tests-rest: one each per device
#                                      # command on a slow host; SANITIZED=1 forces the sanitizer)
#   bash scripts/gpu_suite.sh bench    # dispatch, decode, pool, HF, sanitizer benchmarks
#   bash scripts/gpu_suite.sh engine   # modes benchmark, decode and engine demos
#   bash scripts/gpu_suite.sh tp       # tensor parallel on every visible GPU (needs >= 2)
#   bash scripts/gpu_suite.sh memcheck # the hazard tests under compute-sanitizer memcheck
#                                      # (result: $OUT/r/memcheck.json)
#   bash scripts/gpu_suite.sh weights  # update_weights vs recapture, check_weights alone
#   bash scripts/gpu_suite.sh canary   # the replay canary's throughput cost at N=1000 and 100
#   bash scripts/gpu_suite.sh canary-hf # no canary false positive: 10,000 checks on each of
#                                      # three HF families with GraphedCausalLM, bf16
#   bash scripts/gpu_suite.sh lazy     # lazy capture vs eager and the full ladder: start-up,
#                                      # steady ms/step, graph memory (LAZY_ARGS=--parts ref)
#   bash scripts/gpu_suite.sh all      # all of them (or a list: tests,bench,tp); with 2+
#                                      # GPUs the tests run on the last GPU while the
#                                      # benchmarks time on GPU 0
set -uo pipefail
OUT=${OUT:-out}
R="$OUT/r"
mkdir -p "$R"
export PYTHONPATH=src:ref/src PYTHONUNBUFFERED=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# The commit measured: the device gets a copy of the tree without .git, so the caller
# passes it (GRAPHGUARD_COMMIT=$(git rev-parse HEAD)); every JSON result gets it too.
COMMIT=${GRAPHGUARD_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
{ echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
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
# The suite in two parts, each inside one device command (10 minutes): the files that
# measure device memory or race streams (run alone: nothing else on the device meanwhile),
# then the rest (on a slow host the whole suite took more than 380 s). SANITIZED=1 runs
# them with GRAPHGUARD_SANITIZE=1 GRAPHGUARD_PROVENANCE=1 (docs/sanitizer.md).
SERIAL_TESTS="tests/gpu/test_bad_inputs_gpu.py tests/gpu/test_lazy_first_call_gpu.py
  tests/gpu/test_lazy_gpu.py tests/gpu/test_pool_gpu.py tests/gpu/test_hazards_gpu.py
  tests/gpu/test_semantics_gpu.py tests/test_streams.py tests/test_workspace.py"
rest_tests() { ls tests/gpu/test_*.py | grep -v -E 'bad_inputs|lazy_first_call|lazy_gpu|pool_gpu|hazards|semantics'; }
pytest_env() { if [[ ${SANITIZED:-} == 1 ]]; then echo env GRAPHGUARD_SANITIZE=1 GRAPHGUARD_PROVENANCE=1; else echo env; fi; }
run_tests() {
  local tag=${SANITIZED:+-sanitized}
  # shellcheck disable=SC2046,SC2086
  { has tests || has tests-serial; } && step "gpu-tests-serial$tag" 240 $(pytest_env) python3 -m pytest \
    $SERIAL_TESTS -q -rfEs -p no:cacheprovider --durations=8
  # The canary plant test kills the CUDA context when it goes wrong: run it apart.
  # shellcheck disable=SC2046,SC2086
  { has tests || has tests-rest; } && step "gpu-tests-rest$tag" 540 $(pytest_env) python3 -m pytest \
    $(rest_tests) -k 'not re_created_outside_a_refit' -q -rfEs -p no:cacheprovider --durations=8
  { has tests || has tests-rest; } && step "gpu-tests-plant$tag" 120 $(pytest_env) python3 -m pytest \
    tests/gpu/test_hf_continuous_gpu.py -k re_created_outside_a_refit -q -rfEs -p no:cacheprovider
  return 0
}
any_tests() { has tests || has tests-serial || has tests-rest; }
if has tests && [[ $what != tests && $NGPU -ge 2 ]]; then
  # Tests on the last GPU, in the background; benchmarks alone on GPU 0.
  ( export CUDA_VISIBLE_DEVICES=$((NGPU - 1)); TAIL=25 run_tests > "$R/gpu-tests.tail" 2>&1; exit $status ) &
  tests_pid=$!
elif any_tests; then
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
has weights && TAIL=12 step weights 180 python3 bench/bench_weights.py --out "$R"
has lazy && TAIL=14 step lazy 420 env GRAPHGUARD_COMMIT="$COMMIT" python3 bench/bench_lazy.py --out "$R" ${LAZY_ARGS:-}
has canary && TAIL=12 step canary 240 python3 bench/bench_canary.py --out "$R" --reps 1000 --blocks 3
has canary-hf && TAIL=6 step canary-hf 300 env GRAPHGUARD_COMMIT="$COMMIT" python3 bench/canary_hf_soak.py --out "$R"
has modes && TAIL=25 step modes 240 python3 bench/bench_modes.py --out "$R"
has demo && TAIL=12 step demo 200 python3 -m graphguard_ref.cli --steps 300
has demo-engine && TAIL=25 step demo-engine 240 python3 -m graphguard_ref.cli \
  --mode full_and_piecewise --spec-tokens 2 --max-batch 64 --steps 300
# memcheck: the GPU hazard tests under compute-sanitizer. Group "graphguard": the seeds'
# two hazards (arena growth, aux stream at the capture boundary), ambient autocast and
# generators, all with graphguard's lifecycle: 0 errors and every test passing expected.
# Group "handrolled": the unprotected variant of each (hand-rolled torch.cuda.graph);
# each test asserts the wrong result or failure it reports, which memcheck may not see
# (the caching allocator keeps freed blocks mapped). Both groups run at once. The aux-stream
# race (test_2a) runs without the sanitizer ("race"): memcheck serializes kernels, so the
# aux stream is never still busy under it.
run_memcheck() {
  local cs files k_gg k_hr
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
  if [[ -z $cs ]]; then
    echo "!! memcheck: no compute-sanitizer on PATH or in /usr/local/cuda*/bin"; status=1
    echo '{"available": false}' > "$R/memcheck.json"
    return
  fi
  files="tests/gpu/test_hazards_gpu.py tests/gpu/test_semantics_gpu.py"
  k_gg="(test_1b or test_1c or test_2b or semantics) and not handrolled"
  k_hr="test_1a or handrolled"
  local limit=${MEMCHECK_TIMEOUT:-900}
  # shellcheck disable=SC2086
  TAIL=8 step memcheck-graphguard "$limit" "$cs" --tool memcheck --report-api-errors no \
    --print-limit 20 python3 -m pytest $files -k "$k_gg" -q -rA -p no:cacheprovider &
  # shellcheck disable=SC2086
  TAIL=8 step memcheck-handrolled "$limit" "$cs" --tool memcheck --report-api-errors no \
    --print-limit 20 python3 -m pytest $files -k "$k_hr" -q -rA -p no:cacheprovider &
  wait
  TAIL=4 step memcheck-race 120 python3 -m pytest tests/gpu/test_hazards_gpu.py -k test_2a -q \
    -rA -p no:cacheprovider
  python3 - "$R" "$cs" <<'PY'
import json, re, subprocess, sys
r, cs = sys.argv[1], sys.argv[2]
version = subprocess.run([cs, "--version"], capture_output=True, text=True).stdout.strip()
out = {"available": True, "tool": f"{cs} --tool memcheck --report-api-errors no",
       "version": version.splitlines()[-1] if version else "", "groups": {}}
for group in ("graphguard", "handrolled", "race"):
    text = open(f"{r}/memcheck-{group}.log", errors="replace").read()
    summary = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    lines = [ln for ln in text.splitlines() if "ERROR SUMMARY" not in ln
             and re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s", ln)]
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in
              re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1] if lines else "")}
    out["groups"][group] = {
        "memcheck_errors": int(summary[-1]) if summary else None,
        "tests": re.findall(r"^(?:PASSED|FAILED|ERROR) \S+", text, re.M),
        "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
        "errors": counts.get("error", 0), "skipped": counts.get("skipped", 0),
        "finished": bool(summary)}
g = out["groups"]
g["race"]["memcheck_errors"] = "not run under the sanitizer (it serializes kernels)"
clean = all(v["failed"] == v["errors"] == 0 and v["passed"] > 0 for v in g.values())
out["ok"] = clean and g["graphguard"]["memcheck_errors"] == 0 and g["handrolled"]["finished"]
json.dump(out, open(f"{r}/memcheck.json", "w"), indent=2)
print(json.dumps(out, indent=2))
sys.exit(0 if out["ok"] else 1)
PY
  [[ $? -eq 0 ]] || status=1
}
has memcheck && run_memcheck
unset CUDA_VISIBLE_DEVICES
if [[ -n ${tests_pid:-} ]]; then
  wait "$tests_pid" || status=1
  cat "$R/gpu-tests.tail"
fi
if has tp && [[ $NGPU -ge 2 ]]; then
  TAIL=20 step tp-tests 240 python3 -m pytest tests/gpu/test_distributed_gpu.py -q -rfEs -p no:cacheprovider
  OUT="$R" TAIL=15 step tp 300 bash scripts/run_tp.sh "$NGPU"
fi
python3 - "$R" "$COMMIT" <<'PY'
import json, pathlib, sys
for f in pathlib.Path(sys.argv[1]).glob("*.json"):  # each result names the commit it measured
    try:
        data = json.loads(f.read_text())
    except ValueError:
        continue
    if isinstance(data, dict) and "commit" not in data:
        f.write_text(json.dumps({"commit": sys.argv[2], **data}, indent=2))
PY
tar -czf "$OUT/results.tgz" -C "$R" .
exit $status
