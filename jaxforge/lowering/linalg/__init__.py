"""Lowerings of the linear-algebra primitives, one package per op."""

from jaxforge.lowering.linalg import lstsq, svd, sylvester  # noqa: F401  (importing registers)
