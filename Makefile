# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-all lint bench bench-report clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/tightfit demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy core plugins

# The default run skips only cases marked `slow` (see pyproject.toml); `make test-all` runs everything.
test: setup lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Results go to runs/bench-<time>/; `make bench-report` also replaces the committed benchmarks/results/.
bench: setup
	$(VENV)/bin/tightfit bench

bench-report: setup
	$(VENV)/bin/tightfit bench --update-report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
