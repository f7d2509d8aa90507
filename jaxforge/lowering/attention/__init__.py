"""Lowerings of the attention primitives, one package per op."""

from jaxforge.lowering.attention import attention  # noqa: F401  (importing registers)
