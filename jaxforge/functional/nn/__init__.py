"""``jf.nn``: functional layers. Each ``layer(params, x)`` has an ``init_layer(key, ...)`` returning
its params as a plain dict, so optax optimisers, ``jax.tree`` and ``jf.shard`` specs apply as they are.

Signatures carry shapes (jaxtyping); the test suite checks them at run time with beartype.
"""

from jaxforge.functional.nn.attention import dot_product_attention as dot_product_attention
from jaxforge.functional.nn.attention import init_kv_cache as init_kv_cache
from jaxforge.functional.nn.attention import init_multi_head_attention as init_multi_head_attention
from jaxforge.functional.nn.attention import multi_head_attention as multi_head_attention
from jaxforge.functional.nn.attention import qk_clip as qk_clip
from jaxforge.functional.nn.attention import rotary_embedding as rotary_embedding
from jaxforge.functional.nn.latent_attention import init_latent_cache as init_latent_cache
from jaxforge.functional.nn.latent_attention import init_multi_head_latent_attention as init_multi_head_latent_attention
from jaxforge.functional.nn.latent_attention import multi_head_latent_attention as multi_head_latent_attention
from jaxforge.functional.nn.layers import embedding as embedding
from jaxforge.functional.nn.layers import init_embedding as init_embedding
from jaxforge.functional.nn.layers import init_layer_norm as init_layer_norm
from jaxforge.functional.nn.layers import init_linear as init_linear
from jaxforge.functional.nn.layers import init_mlp as init_mlp
from jaxforge.functional.nn.layers import init_rms_norm as init_rms_norm
from jaxforge.functional.nn.layers import layer_norm as layer_norm
from jaxforge.functional.nn.layers import linear as linear
from jaxforge.functional.nn.layers import mlp as mlp
from jaxforge.functional.nn.layers import rms_norm as rms_norm
from jaxforge.functional.nn.recurrent import gru as gru
from jaxforge.functional.nn.recurrent import init_gru as init_gru
from jaxforge.functional.nn.recurrent import init_lstm as init_lstm
from jaxforge.functional.nn.recurrent import lstm as lstm
from jaxforge.functional.nn.transformer import cross_entropy as cross_entropy
from jaxforge.functional.nn.transformer import init_transformer as init_transformer
from jaxforge.functional.nn.transformer import transformer as transformer

__all__ = [
    "cross_entropy",
    "dot_product_attention",
    "embedding",
    "gru",
    "init_embedding",
    "init_gru",
    "init_kv_cache",
    "init_latent_cache",
    "init_layer_norm",
    "init_linear",
    "init_lstm",
    "init_mlp",
    "init_multi_head_attention",
    "init_multi_head_latent_attention",
    "init_rms_norm",
    "init_transformer",
    "layer_norm",
    "linear",
    "lstm",
    "mlp",
    "multi_head_attention",
    "multi_head_latent_attention",
    "qk_clip",
    "rms_norm",
    "rotary_embedding",
    "transformer",
]
