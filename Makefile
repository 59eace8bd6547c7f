# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint docs docs-serve report bench bench-report gpu-check mutate clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/tightfit demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy core plugins

# Every test, in two pytest-xdist workers (CI has 2 cores), whole test files per worker (tests/conftest.py);
# `TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup lint
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The docs site (mkdocs-material, API pages from the docstrings) into site/; --strict fails on a broken link, a page
# missing from the nav or an API name that does not resolve. tests/test_docs.py builds it too.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# Regenerate benchmarks/results/REPORT.md and the README's results table from the committed JSON (no benchmark runs).
report: setup
	$(PY) -m benchmarks.report

# Results go to runs/bench-<time>/; `make bench-report` also replaces the committed benchmarks/results/.
# Each benchmark's wall time is printed as it ends and, for a whole-suite run, kept in results/suite.json.
# `make bench ONLY=sky_simulation` runs one benchmark (repeatable: ONLY="a b").
BENCH_ONLY = $(foreach name,$(ONLY),--only $(name))

bench: setup
	$(VENV)/bin/tightfit bench $(BENCH_ONLY)

bench-report: setup
	$(VENV)/bin/tightfit bench --update-report $(BENCH_ONLY)

# On the GPU machine (no setup: its image's packages, the checkout linked in place): tests/gpu + benchmarks/gpu
# quick, within 8 minutes, summary under $$OUT or benchmarks/results/gpu/. `make gpu-check DRY=1` anywhere.
gpu-check:
	bash scripts/gpu_check.sh $(if $(DRY),--dry,)

# Mutation testing of the cost models and the cache policy (not part of `make test`): mutmut under a
# wall-clock budget, then the survivors and the score. MUTATE_MINUTES=12 by default; MUTATE_SCOPE=full adds the
# Elixir planner and the profiler, MUTATE_SCOPE=disk takes the storage, quantizers and disk tier; see scripts/mutate.sh.
mutate: setup
	@PY=$(PY) bash scripts/mutate.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
