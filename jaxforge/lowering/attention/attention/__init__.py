"""Every lowering of the three attention primitives is registered here, and nowhere else.

The ``implementation`` parameter picks the algorithm: "xla" (kernel.py's tiles in XLA, every
platform) or "pallas_triton" (the same tiles as Pallas kernels: Triton on GPU, interpret mode on
CPU). ``None`` means "pallas_triton" on GPU and "xla" elsewhere.
"""

from jaxforge.lowering.attention.attention import xla
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import attention_bwd_p, attention_fwd_p, attention_tangent_p

# primitive -> {implementation name: lowering in jax ops}; tests run every entry against the reference.
IMPLEMENTATIONS = {
    attention_fwd_p: {"xla": xla.attention_fwd_xla},
    attention_tangent_p: {"xla": xla.attention_tangent_xla},
    attention_bwd_p: {"xla": xla.attention_bwd_xla},
}


def _dispatch(prim, default: str):
    def lowering(*args, implementation, **params):
        impls = IMPLEMENTATIONS[prim]
        return impls[implementation.name or default](*args, implementation=implementation, **params)

    return lowering


for _prim in IMPLEMENTATIONS:
    _core.register_lowering(_prim, _dispatch(_prim, "xla"))
