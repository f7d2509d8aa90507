"""The README's quick examples run as written, one namespace, in order."""

import pathlib
import re

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_examples_run():
    text = (ROOT / "README.md").read_text()
    section = re.search(r"## Quick example\n(.*?)\n## ", text, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    with jax.numpy_rank_promotion("allow"):  # user code, under JAX's default
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["x"].shape == (32,) and namespace["ga"].shape == (128, 50, 8)
    assert namespace["out"].shape == (2, 256, 8, 64)
