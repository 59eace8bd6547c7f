# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-all lint bench mutate clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/tightfit demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy core

# The default run skips only cases marked `slow` (see pyproject.toml); `make test-all` runs everything.
test: setup lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m benchmarks.run --quick

# Mutation testing of the cost models and the cache policy (not part of `make test`): mutmut under a
# wall-clock budget, then the survivors and the score. MUTATE_MINUTES=12 by default; see scripts/mutate.sh.
mutate: setup
	@PY=$(PY) bash scripts/mutate.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
