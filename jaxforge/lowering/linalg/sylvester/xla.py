"""Default lowering of sylvester_p on every platform: products in ``P``'s eigenbasis."""

from __future__ import annotations

import jax.numpy as jnp

from jaxforge.primitives.linalg._ops import ct, mm


def sylvester_xla(p, s, v, c, *, two_sided: bool):
    r""":math:`V[(V^H C V) \circ K]V^H` with :math:`K_{jk} = 1/(s_j + s_k)` (two-sided; real input
    drops the diagonal), or :math:`C V S^{-1} V^H`."""
    del p  # its eigendecomposition (s, v) is what is applied
    if not two_sided:
        return (mm(mm(c, v) / s.astype(c.dtype)[..., None, :], ct(v)),)
    sums = s[..., :, None] + s[..., None, :]
    if jnp.iscomplexobj(c):
        k = 1 / sums
    else:  # a skew matrix's diagonal is 0 in every basis: no 0·∞ at a zero eigenvalue
        diagonal = jnp.eye(s.shape[-1], dtype=bool)
        k = jnp.where(diagonal, 0, 1 / jnp.where(diagonal, 1, sums))
    return (mm(v, mm(mm(ct(v), mm(c, v)) * k.astype(c.dtype), ct(v))),)
