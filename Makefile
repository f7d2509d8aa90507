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

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal tests

bench: $(STAMP)
	$(PY) -m jaxforge.bench linalg

clean:
	rm -rf $(VENV) .pytest_cache
