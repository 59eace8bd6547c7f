#!/usr/bin/env bash
# `make mutate`: mutation testing (mutmut 3) of the cost models and the cache policy (or, by MUTATE_SCOPE, of
# the storage, quantization and disk-runtime code), under a time budget.
#
# mutmut names a mutant after its file's path, so the code must be importable under the name its folder
# has; ours is not (core/ is imported as `tightfit`, plugins/torchrec_cache as `torchrec_cache`). The run
# therefore happens in a staging folder that lays the packages out under their import names, with the
# tests and a pyproject.toml that carries the [tool.mutmut] section. mutmut puts its mutated copy first on
# sys.path, which wins over the editable install.
#
# Environment:
#   MUTATE_SRC      tree to test (default: this checkout; point it at an exported commit to score an old tree)
#   MUTATE_MINUTES  wall-clock budget of `mutmut run` (default 12); the score counts the mutants it reached
#   MUTATE_CHILDREN parallel test processes (default 1: the machine is shared)
#   MUTATE_SCOPE    fast (default), full or disk: the default files and tests (below)
#   MUTATE_FILES    files to mutate, as import paths (default below)
#   MUTATE_TESTS    test files that may kill them (default below)
set -uo pipefail
set -f  # file patterns below are for mutmut, not the shell
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=${MUTATE_SRC:-$ROOT}
MINUTES=${MUTATE_MINUTES:-12}
CHILDREN=${MUTATE_CHILDREN:-1}
STAGE=${MUTATE_STAGE:-$ROOT/build/mutate}
PY=${PY:-$ROOT/.venv/bin/python}
case $PY in /*) ;; *) PY=$ROOT/$PY ;; esac  # the run happens in the staging folder
MUTMUT="$(dirname "$PY")/mutmut"
# Three scopes. "fast" (default) fits a 12-minute budget on two shared cores: the pipeline cost model, cache
# sizing, pool planning and the cache policy, against their fast tests (the pipeline's 45-second gloo test
# is left out). "full" adds core/planner/ (Elixir) and core/profiler/memory.py with the profiler tests,
# whose clean run alone takes ~5 minutes here: give it MUTATE_MINUTES=60 or more. "disk" is the storage,
# quantization and disk-runtime code: core/storage/ (the store, staging, external reads), the quantizers
# (core/kernels/quant_linear*.py, energon_infer/loading/quantization.py) and the embedding cache's disk tier
# (torchrec_cache/disk.py, hostlevel.py), against the storage tests, the quantization tests checked against
# torchao, and the in-process disk-tier tests (one optimizer of the four, no multi-process engine test). mutmut
# maps a function to the tests that call it in the test process: code that runs only in a worker process is
# reported "no tests". It has thousands of mutants: a 20-minute budget scores the cheapest few hundred.
SCOPE=${MUTATE_SCOPE:-fast}
case $SCOPE in fast | full | disk) ;; *)
  echo "[mutate] MUTATE_SCOPE=$SCOPE is not a scope: use fast, full or disk (or set MUTATE_FILES/MUTATE_TESTS)" >&2
  exit 2 ;;
esac
FAST_FILES="tightfit/planner/pipeline/problem.py tightfit/planner/cache.py tightfit/planner/pool.py \
torchrec_cache/cache.py"
FAST_TESTS="tests/core/test_planner_pipeline.py tests/core/test_planner_pool.py tests/core/test_planner_costs.py \
tests/torchrec_cache/test_planner.py tests/torchrec_cache/test_policy_behaviour.py"
DISK_FILES="tightfit/storage/* tightfit/cuda/quant_linear.py tightfit/cuda/quant_linear_a8.py \
energon_infer/loading/quantization.py torchrec_cache/disk.py torchrec_cache/hostlevel.py"
A8=tests/core/test_quant_linear_a8.py
QZ=tests/energon_infer/test_quantization.py
DK=tests/torchrec_cache/test_disk.py
DISK_TESTS="tests/core/test_storage.py tests/core/test_storage_corruption.py tests/core/test_storage_durability.py \
tests/core/test_storage_ranges.py tests/core/test_storage_staging.py tests/core/test_storage_external.py \
tests/core/test_storage_reuse.py tests/core/test_storage_model.py tests/core/test_storage_bounds.py \
tests/core/test_quant_linear.py $A8::test_the_rounding_noise_check_rejects_coarser_activations \
$A8::test_error_is_within_the_stated_bound_of_the_dequantised_product $A8::test_quantize_activations_per_block_of_128 \
$A8::test_quantize_activations_rounds_within_half_a_step \
tests/energon_infer/test_quantization_torchao.py $QZ::test_torchao_formats_are_the_stored_ones \
$QZ::test_quantizing_rows_at_a_time_gives_the_values_of_all_at_once $QZ::test_bad_quantization_is_refused_at_load_in_one_line \
$DK::test_tables_on_disk_train_like_ebc[sgd] $DK::test_embedding_collection_on_disk_trains_like_ec \
$DK::test_lookahead_reads_the_window_from_disk \
$DK::test_save_and_load_tables_stream_chunks $DK::test_load_tables_refuses_a_checkpoint_of_other_tables \
$DK::test_disk_dir_that_cannot_hold_the_tables_is_refused $DK::test_tables_larger_than_the_disk_are_refused_at_construction \
$DK::test_disk_full_on_write_back_raises_and_loses_no_row $DK::test_corrupted_row_file_raises_naming_table_and_rows \
$DK::test_host_level_always_returns_the_latest_row $DK::test_disk_settings_are_accepted_or_refused_in_one_line \
$DK::test_state_dict_streams_to_mapped_files_and_loads_back"
if [ "$SCOPE" = disk ]; then
  DEFAULT_FILES=$DISK_FILES
  DEFAULT_TESTS=$DISK_TESTS
elif [ "$SCOPE" = full ]; then
  DEFAULT_FILES="tightfit/planner/* tightfit/planner/pipeline/* tightfit/profiler/memory.py torchrec_cache/cache.py"
  DEFAULT_TESTS="$FAST_TESTS tests/core/test_planner_elixir.py tests/core/test_planner_elixir_costs.py \
tests/core/test_profiler_model.py"
else
  DEFAULT_FILES=$FAST_FILES
  DEFAULT_TESTS=$FAST_TESTS
fi
FILES=${MUTATE_FILES:-$DEFAULT_FILES}
TESTS=${MUTATE_TESTS:-$DEFAULT_TESTS}
DESELECT=${MUTATE_DESELECT:-"tests/core/test_planner_pipeline.py::test_plan_round_trips_json_exactly_and_every_rank_gets_rank0s"}

if [ ! -x "$MUTMUT" ]; then
  echo "[mutate] installing mutmut into $(dirname "$(dirname "$PY")")"
  "$PY" -m pip --disable-pip-version-check install -q "mutmut==3.8.1" || exit 1
fi

rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -r "$SRC/core" "$STAGE/tightfit"
cp -r "$SRC/plugins/torchrec_cache" "$STAGE/torchrec_cache"
cp -r "$SRC/plugins/energon_infer" "$STAGE/energon_infer"
cp -r "$SRC/tests" "$STAGE/tests"
cp "$SRC/README.md" "$STAGE/README.md"  # tests run the README's snippets
[ -d "$SRC/docs" ] && cp -r "$SRC/docs" "$STAGE/docs"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +

tests=()
for t in $TESTS; do [ -f "$STAGE/${t%%::*}" ] && tests+=("$t"); done  # an older tree may lack some
toml_list() { local out="" x; for x in "$@"; do out+="\"$x\", "; done; echo "[${out%, }]"; }
# shellcheck disable=SC2086
{
  "$PY" - "$SRC/pyproject.toml" <<'EOF'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))["tool"]["pytest"]["ini_options"]
print("[tool.pytest.ini_options]")
for k, v in cfg.items():
    if k != "testpaths":
        print(f"{k} = {v!r}".replace("'", '"'))
EOF
  echo
  echo "[tool.mutmut]"
  echo 'source_paths = ["tightfit", "torchrec_cache", "energon_infer"]'
  echo "only_mutate = $(toml_list $FILES)"
  echo "pytest_add_cli_args_test_selection = $(toml_list "${tests[@]}")"
  deselect=(); for d in $DESELECT; do deselect+=("--deselect" "$d"); done
  echo "pytest_add_cli_args = $(toml_list -p no:cacheprovider -x -q "${deselect[@]}")"
  echo 'also_copy = ["README.md", "docs"]'
  echo "use_git_change_detection = false"
} >"$STAGE/pyproject.toml"

cd "$STAGE" || exit 1
echo "[mutate] mutating: $FILES"
echo "[mutate] tests: ${tests[*]}"
echo "[mutate] budget: ${MINUTES} min, ${CHILDREN} process(es); staging in $STAGE"
timeout --signal=INT --kill-after=30 "${MINUTES}m" "$MUTMUT" run --max-children "$CHILDREN" >"$STAGE/run.log" 2>&1
rc=$?
if grep -q "failed to collect stats\|Failed to run clean test" "$STAGE/run.log"; then
  tr '\r' '\n' <"$STAGE/run.log" | tail -n 40
  echo "[mutate] the unmutated tests failed in the staging tree ($STAGE); fix that first"
  exit 1
fi
[ $rc -eq 124 ] || [ $rc -eq 130 ] && echo "[mutate] time budget reached; scoring the mutants run so far"
tail -n 3 "$STAGE/run.log" | tr '\r' '\n' | tail -n 2
"$MUTMUT" results --all true >"$STAGE/results.txt" 2>/dev/null || "$MUTMUT" results --all >"$STAGE/results.txt" 2>/dev/null
"$PY" - "$STAGE/results.txt" <<'EOF'
import collections, re, sys
counts, survivors = collections.Counter(), []
per_file = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    name, _, status = line.strip().rpartition(": ")
    if not name:
        continue
    counts[status] += 1
    per_file[re.split(r"\.x[\u01c1_]", name, maxsplit=1)[0]][status] += 1
    if status in ("survived", "no tests"):
        survivors.append(f"{name} ({status})")
killed, survived = counts["killed"] + counts["timeout"], counts["survived"] + counts["no tests"]
print(f"[mutate] {dict(counts)}")
for s in survivors:
    print(f"  survived: {s}")
done = killed + survived
for module, c in sorted(per_file.items()):
    k, d = c["killed"] + c["timeout"], c["killed"] + c["timeout"] + c["survived"] + c["no tests"]
    print(f"[mutate]   {module}: {k}/{d} killed ({c['no tests']} with no test, {c['not checked']} not reached)")
print(f"[mutate] score: {killed}/{done} killed = {100 * killed / max(1, done):.1f}% of the mutants reached "
      f"(survivors include {counts['no tests']} that no selected test runs; {counts['not checked']} not reached "
      "in the budget)")
EOF
