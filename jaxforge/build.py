"""``python -m jaxforge.build``: compile (and load) the CUDA kernels ahead of first use.

See :mod:`jaxforge.lowering.build`.
"""

import sys

from jaxforge.lowering.build import main

if __name__ == "__main__":
    sys.exit(main())
