"""jaxforge: differentiable linear algebra, flex attention and collectives as JAX primitives.

Public surface::

    jf.attention(q, k, v, *, mask=None, score_mod=None, scale=None, softcap=None,
                 return_lse=False, sinks=None, implementation=None)
    jf.masks.causal(), sliding_window(w), document(segment_ids), prefix_lm(n), padding(kv_lengths), ...
    jf.collectives.all_reduce(x, axis_name, op="sum"), all_gather, reduce_scatter, all_to_all, ...
    jf.nn.linear, rms_norm, multi_head_attention, multi_head_latent_attention, transformer, lstm, gru, cross_entropy, ... (+ init_*)
    jf.nn.dot_product_attention(query, key, value, bias=None, mask=None, *, ...)  # jax.nn's, on jf.attention
    jf.export.save(fn, args, path), jf.export.load(path)  # jax.export artifacts, checked on load
    jf.shard(f, *, mesh=None, in_specs, out_specs)
    jf.remat.save_attention(*names, policy=None), save_linalg  # jax.checkpoint policies keeping their residuals
    jf.parallel.column_parallel_linear, row_parallel_linear, sequence_parallel_rms_norm, ring_attention, all_gather_attention
    jf.linalg.svd(a, full_matrices=False, compute_uv=True, *, grad_eps=0.0)
    jf.linalg.lstsq(a, b, rcond=None) -> LstsqResult(solution, residuals, rank, singular_values)
    jf.linalg.svdvals(a), pinv(a, rtol=None, hermitian=False, *, atol=None), matrix_rank(a, rtol=None, hermitian=False, *, atol=None)
    jf.linalg.polar(a, side="right") -> (u, p)
"""

__version__ = "0.1.0"  # before the imports: jaxforge.export records it

from jaxforge import lowering as _lowering  # noqa: F401  (registers every lowering, once)
from jaxforge import export as export
from jaxforge.functional import collectives as collectives
from jaxforge.functional import linalg as linalg
from jaxforge.functional import masks as masks
from jaxforge.functional import nn as nn
from jaxforge.functional import parallel as parallel
from jaxforge.functional.attention import attention as attention
from jaxforge.transforms import remat as remat
from jaxforge.transforms.shard import shard as shard

__all__ = ["attention", "collectives", "export", "linalg", "masks", "nn", "parallel", "remat", "shard"]
