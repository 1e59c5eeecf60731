set -x
export PYTHONPATH=src:ref/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 bench/probes/probe_refit_cost.py --out $OUT > $OUT/refit-cost.log 2>&1; echo rc=$?
tail -c 6000 $OUT/refit-cost.log
timeout 300 python3 bench/probes/probe_rl_stale.py --out $OUT --steps 14 > $OUT/rl-stale.log 2>&1; echo rc=$?
grep -v "^\[" $OUT/rl-stale.log | tail -c 5000
