"""The demo runs end to end (tiny benchmark) and every check in it passes."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_quick_passes():
    done = subprocess.run(
        [sys.executable, "-m", "jaxforge.demo", "--quick"], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jf.linalg.svd" in done.stdout and "jf.linalg.lstsq" in done.stdout
    assert "[FAIL]" not in done.stdout
    assert "quick_tall" in done.stdout and "ratio" in done.stdout  # the benchmark table
