#!/usr/bin/env bash
# Run every benchmarks/gpu/*.py on this machine's GPU, within an 8-minute budget, then print a
# short table of what each found. Results: JSON under $OUT (or benchmarks/results/gpu/).
#   bash benchmarks/gpu/run_all.sh [--quick]
# Uses only the image's packages (torch, Triton, Lightning, transformers); a script whose needs are
# missing records itself as skipped. A script that overruns its share of the budget is stopped.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUDGET=${TIGHTFIT_GPU_BUDGET_S:-450}
OUTDIR=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUTDIR"
start=$(date +%s)
# Order and weight of each script's share of what is left (the fast, fundamental ones first; a script
# that finishes early leaves its time to the next). Scripts not listed run last with weight 10.
ORDER=(kernels torchrec_cache energon energon_graphs elixir cost_model energon_engine)
declare -A WEIGHT=([kernels]=8 [torchrec_cache]=8 [energon]=10 [energon_graphs]=5 [elixir]=11 [cost_model]=12 [energon_engine]=13)
scripts=()
for name in "${ORDER[@]}"; do [ -f "benchmarks/gpu/$name.py" ] && scripts+=("$name"); done
for f in benchmarks/gpu/*.py; do
  name=$(basename "$f" .py)
  case "$name" in common|__init__|_*) continue ;; esac
  case " ${scripts[*]} " in *" $name "*) ;; *) scripts+=("$name") ;; esac
done
weights_left=0
for name in "${scripts[@]}"; do weights_left=$(( weights_left + ${WEIGHT[$name]:-10} )); done
for name in "${scripts[@]}"; do
  w=${WEIGHT[$name]:-10}
  now=$(date +%s); remaining=$(( BUDGET - (now - start) ))
  if [ "$remaining" -lt 20 ]; then
    echo "[gpu] $name: not run, budget of ${BUDGET}s spent"
    "$PY" -c "from benchmarks.gpu.common import skip; skip('$name', '$name', 'budget spent before it ran')"
    weights_left=$(( weights_left - w )); continue
  fi
  share=$(( remaining * w / weights_left )); weights_left=$(( weights_left - w ))
  echo "[gpu] $name (up to ${share}s)"
  timeout --kill-after=10 "$share" "$PY" -m "benchmarks.gpu.$name" "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    why="exit $rc"; [ "$rc" -eq 124 ] && why="stopped after ${share}s"
    echo "[gpu] $name FAILED ($why)"
    "$PY" -c "from benchmarks.gpu.common import write_result; write_result('$name', title='$name', results={}, summary='failed: $why', status='failed')" || true
  fi
done
echo
echo "GPU benchmarks ($(( $(date +%s) - start ))s):"
"$PY" -m benchmarks.gpu.common "$OUTDIR"
