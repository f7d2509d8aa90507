"""How each primitive becomes code on each platform. Importing this package registers them all, once.

Layout: ``lowering/<family>/<op>/__init__.py`` registers every lowering of that op; ``xla.py`` is the
default lowering (jax operations, LAPACK on CPU), which runs on every platform.
"""

from jaxforge.lowering import attention, linalg  # noqa: F401  (importing registers)
