#!/usr/bin/env bash
# One prepared GPU check for a short loan: tests/gpu/ on CUDA, then benchmarks/gpu/ in quick mode, then one
# summary (JSON + Markdown + the log) under $OUT, or benchmarks/results/gpu/ when OUT is unset.
#
#   make gpu-check              # on the GPU machine (or: bash scripts/gpu_check.sh)
#   make gpu-check DRY=1        # anywhere, no GPU: checks that it starts, collects every GPU test, finds
#                               # every benchmark (each answers --help) and writes the summary
#
# The GPU machine's image has torch, Triton, Lightning and transformers and nothing can be installed
# there, and our .venv does not travel: the checkout is made importable by linking each package folder
# under its import name (core -> tightfit, plugins/<name> -> <name>) in a temporary folder put first on
# PYTHONPATH, which spawned workers inherit. Budget: 8 minutes in all. Per-part limits (seconds):
# tests 200 (TIGHTFIT_GPU_TEST_BUDGET_S), benchmarks 250 (TIGHTFIT_GPU_BUDGET_S, shared by run_all.sh);
# each part is stopped at its limit and what it finished is still summarised. At most 3 files go
# to $OUT (the loan returns 8 at most): gpu_check.json, gpu_check.md, gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry) DRY=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --dry or nothing)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
DEST=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$DEST"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tightfit-gpu-check.XXXXXX")
LOG="$WORK/gpu_check.log"
TEST_BUDGET=${TIGHTFIT_GPU_TEST_BUDGET_S:-200}
export TIGHTFIT_GPU_BUDGET_S=${TIGHTFIT_GPU_BUDGET_S:-250}
start=$(date +%s)
say() { echo "[gpu-check] $*" | tee -a "$LOG"; }

# 1. The checkout, importable from the image's packages alone.
LINKS="$WORK/src"
mkdir -p "$LINKS"
ln -s "$ROOT/core" "$LINKS/tightfit"
for d in "$ROOT"/plugins/*/; do
  [ -f "$d/__init__.py" ] && ln -s "${d%/}" "$LINKS/$(basename "$d")"
done
export PYTHONPATH="$LINKS:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Compiled kernels, not the interpreter (tests/conftest.py defaults to TRITON_INTERPRET=1 for the CPU
# suite); the dispatcher decides per call as a user's run would.
export TRITON_INTERPRET=0
unset TIGHTFIT_KERNELS
say "python $PY; packages linked from $LINKS; dry=$DRY; results to $DEST"
"$PY" - "$LINKS" "$ROOT" 2>&1 <<'PYEOF' | tee -a "$LOG" "$WORK/imports.txt"
import importlib, os, sys
for name in sorted(os.listdir(sys.argv[1])):
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # e.g. a plugin whose host framework the image lacks
        print(f"import {name}: FAILED {type(exc).__name__}: {exc}")
        continue
    linked = module.__file__.startswith(sys.argv[1])  # found through the links, not an installed copy
    origin = os.path.realpath(os.path.dirname(module.__file__))
    where = "checkout" if origin.startswith(os.path.realpath(sys.argv[2])) else "elsewhere"
    print(f"import {name}: {'linked' if linked else 'installed'} from {where} {origin}")
PYEOF

# 2. The GPU tests, every file of tests/gpu/ (kernels first: everything else runs on them).
TESTS=(tests/gpu/test_kernels.py tests/gpu/test_cache.py tests/gpu/test_energon.py tests/gpu/test_elixir.py)
for f in tests/gpu/test_*.py; do
  case " ${TESTS[*]} " in *" $f "*) ;; *) TESTS+=("$f") ;; esac
done
export TIGHTFIT_GPU_REPORT="$WORK/tests.jsonl"
# Collected first: a test the budget stops before it runs is then reported as "not run", not lost.
timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider "${TESTS[@]}" >"$WORK/collected.txt" 2>>"$LOG"
rc=$?
say "collected $(grep -c '::' "$WORK/collected.txt") GPU tests from ${#TESTS[@]} files"
if [ "$DRY" != 1 ]; then
  say "running them (up to ${TEST_BUDGET}s)"
  per_test=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo --timeout=150)
  timeout --kill-after=10 "$TEST_BUDGET" "$PY" -m pytest -q -rs -p no:cacheprovider $per_test \
    "${TESTS[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
fi
echo "$rc" >"$WORK/tests.rc"
say "tests: exit $rc after $(( $(date +%s) - start ))s"

# 3. The GPU benchmarks, quick mode (run_all.sh shares its budget and stops an overrun).
mkdir -p "$WORK/bench"
if [ "$DRY" = 1 ]; then
  for f in benchmarks/gpu/*.py; do
    name=$(basename "$f" .py)
    case "$name" in common|__init__|_*) continue ;; esac
    if timeout 120 "$PY" -m "benchmarks.gpu.$name" --help >>"$LOG" 2>&1; then status=found; else status=broken; fi
    echo "$name $status" >>"$WORK/bench/found.txt"
    say "benchmark $name: $status (--help)"
  done
else
  say "running the GPU benchmarks, quick (up to ${TIGHTFIT_GPU_BUDGET_S}s)"
  OUT="$WORK/bench" PYTHON="$PY" bash benchmarks/gpu/run_all.sh --quick 2>&1 | tee -a "$LOG"
fi

# 4. The summary.
"$PY" scripts/gpu_check_summary.py --work "$WORK" --dest "$DEST" --elapsed "$(( $(date +%s) - start ))" \
  $( [ "$DRY" = 1 ] && echo --dry ) 2>&1 | tee -a "$LOG"
src=${PIPESTATUS[0]}
cp "$LOG" "$DEST/gpu_check.log"
rm -rf "$WORK"
exit "$src"
