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
# about 40% and the suite's CPU time by about a quarter; the older loop emitters in place of the MLIR
# fusion emitters cut a small program's compile from ~86 to ~55 ms and the suite's time by another
# quarter (2026-12-03: 40 -> 29 min on 2 cores). An XLA that lacks a flag aborts on it, so the
# emitters' flag is probed first. A user's own XLA_FLAGS still apply after these.
FAST_COMPILE := --xla_backend_optimization_level=0
LOOP_EMITTERS := --xla_cpu_use_fusion_emitters=false

test: $(STAMP)
	flags="$(FAST_COMPILE)"; \
	if XLA_FLAGS="$(LOOP_EMITTERS)" $(PY) -c "import jax; jax.jit(lambda: 0)()" 2>/dev/null; then flags="$$flags $(LOOP_EMITTERS)"; fi; \
	XLA_FLAGS="$$flags $$XLA_FLAGS" $(PY) -m pytest -q -n 2 --dist worksteal tests

bench: $(STAMP)
	$(PY) -m jaxforge.bench linalg

clean:
	rm -rf $(VENV) .pytest_cache
