"""The README's quick example runs as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_example_runs():
    text = (ROOT / "README.md").read_text()
    example = re.search(r"## Quick example\s+```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["x"].shape == (128, 8) and namespace["ga"].shape == (128, 50, 8)
