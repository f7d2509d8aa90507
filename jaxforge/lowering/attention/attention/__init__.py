"""Every lowering of the three attention primitives is registered here, and nowhere else.

The ``implementation`` parameter picks the algorithm: "xla" (kernel.py's tiles in XLA, every
platform) or "pallas_triton" (the same tiles as Pallas kernels: Triton on GPU, interpret mode on
CPU). ``None`` means "pallas_triton" on GPU and "xla" elsewhere.
"""

from jaxforge.lowering.attention.attention import pallas_triton, xla
from jaxforge.primitives import _core
from jaxforge.primitives.attention.attention import attention_bwd_p, attention_fwd_p, attention_tangent_p

# primitive -> {implementation name: lowering in jax ops}; tests run every entry against the reference.
IMPLEMENTATIONS = {
    attention_fwd_p: {"xla": xla.attention_fwd_xla, "pallas_triton": pallas_triton.attention_fwd_pallas},
    attention_tangent_p: {"xla": xla.attention_tangent_xla, "pallas_triton": pallas_triton.attention_tangent_pallas},
    attention_bwd_p: {"xla": xla.attention_bwd_xla, "pallas_triton": pallas_triton.attention_bwd_pallas},
}


def _dispatch(prim, platform: str | None):
    def lowering(*args, mods, implementation, **params):
        name = implementation.name
        if platform == "cuda":
            if name is None:
                name = "pallas_triton" if pallas_triton.triton_can_run(mods) else "xla"
            elif name == "pallas_triton" and not pallas_triton.triton_can_run(mods):
                raise ValueError(
                    "attention: implementation='pallas_triton' cannot apply this mask/score_mod on GPU: it "
                    "reads a captured array at traced indices (a gather); use implementation=None or 'xla'"
                )
        name = name or "xla"
        extra = {"interpret": platform != "cuda"} if name == "pallas_triton" else {}
        return IMPLEMENTATIONS[prim][name](*args, mods=mods, implementation=implementation, **extra, **params)

    return lowering


for _prim in IMPLEMENTATIONS:
    _core.register_lowering(_prim, _dispatch(_prim, None))
    _core.register_lowering(_prim, _dispatch(_prim, "cuda"), platform="cuda")
