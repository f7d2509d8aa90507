# The two commands: `make demo` (the main job) and `make test` (the whole CPU suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jaxforge.demo

# The suite runs many small programs, so XLA's compile time dominates it: LLVM at -O0 cuts that by
# about 40% and the suite's CPU time by about a quarter (a user's own XLA_FLAGS still apply after it).
test: $(STAMP)
	XLA_FLAGS="--xla_backend_optimization_level=0 $$XLA_FLAGS" $(PY) -m pytest -q -n 2 --dist worksteal tests

bench: $(STAMP)
	$(PY) -m jaxforge.bench linalg

clean:
	rm -rf $(VENV) .pytest_cache
