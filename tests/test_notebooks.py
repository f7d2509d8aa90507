"""The notebooks under notebooks/: each runs without error, and each is committed with its outputs.

Executing a notebook starts a fresh kernel (``notebooks/execute.py``), so those tests are ``slow``.
Refresh the saved outputs with ``python notebooks/execute.py --write [NOTEBOOK ...]``.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a dev dependency; the GPU machine's image lacks it

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _execute_module():
    """notebooks/execute.py, imported from its path (notebooks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("jaxforge_notebooks_execute", NOTEBOOK_DIR / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    _execute_module().execute(path, write=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    counts = [cell.execution_count for cell in code]
    fix = f"run `python notebooks/execute.py --write notebooks/{path.name}` and commit the result"
    assert None not in counts, f"{path.name}: code cells {[i for i, n in enumerate(counts) if n is None]} never ran; {fix}"
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: execution counts {counts} are not one top-to-bottom run; {fix}"
    errors = [out.get("ename") for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name} was saved with errors {errors}; {fix}"


def test_kernel_runs_this_interpreter(tmp_path):
    """execute() starts the kernel on sys.executable, in the notebook's folder."""
    probe = tmp_path / "probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable)\nprint(os.getcwd())")]), probe)
    nb = _execute_module().execute(probe, write=False, timeout=60)
    executable, cwd = nb.cells[0].outputs[0]["text"].split()
    assert Path(executable) == Path(sys.executable)
    assert Path(cwd).resolve() == tmp_path.resolve()
