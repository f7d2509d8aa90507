"""What ``return_max_scores`` costs (QK-clip's statistic: each row's largest logit), side by side
in one process: jf.attention's forward, and a training step's gradient that also reports each
head's largest logit (``jax.grad(..., has_aux=True)``), with and without it; where torch with CUDA
is importable, compiled FlexAttention's forward with and without ``return_aux=AuxRequest(max_scores=True)``.
Each result's maxima against a float32 dense reference (max abs error). The JSON has the bench's
layout (``python -m jaxforge.bench``): the call with the maxima is ``jaxforge``, and each other
row's ``ratio`` is its time over jaxforge's in the same mode (``jaxforge-no-max``: below 1 by what
the maxima cost).

    python benchmarks/max_scores.py [--shapes NAME,...] [--repeats 11] [--out benchmarks/results] [--quick]

Shapes are ``SHAPES`` of the attention primitive (default: long_d128_causal and gqa_8to1 in
bfloat16 on a GPU, cpu_causal in float32 elsewhere); ``--quick``: one small causal call.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxforge as jf
from jaxforge.primitives.attention.attention import SHAPES

GPU_SHAPES, CPU_SHAPES = ("long_d128_causal", "gqa_8to1"), ("cpu_causal",)
QUICK = ((1, 128, 128, 4, 2, 32, 32), "causal")


def _inputs(dims, dtype):
    b, sq, skv, hq, hkv, d, dv = dims
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv)))]


def _mask(name):
    if name not in (None, "causal"):
        raise ValueError(f"max_scores benchmark: causal or unmasked shapes only, got mask {name!r}")
    return jf.masks.causal() if name == "causal" else None


def reference_max_scores(q, k, causal: bool):
    """Each row's largest score in float32, one batch item and key/value head at a time."""
    group = q.shape[2] // k.shape[2]

    @jax.jit
    def one(q_g, k_h):  # (Sq, G, D), (Skv, D)
        s = jnp.einsum("qgd,kd->gqk", q_g.astype(jnp.float32), k_h.astype(jnp.float32), precision="highest") / np.sqrt(q.shape[-1])
        if causal:
            s = jnp.where(jnp.arange(s.shape[2])[None] <= jnp.arange(s.shape[1])[:, None] + s.shape[2] - s.shape[1], s, -jnp.inf)
        return jnp.max(s, axis=-1).T  # (Sq, G)

    rows = [[one(q[b, :, h * group : (h + 1) * group], k[b, :, h]) for h in range(k.shape[2])] for b in range(q.shape[0])]
    return jnp.stack([jnp.concatenate(r, axis=1) for r in rows])


def jax_variants(mask, gpu: bool):
    """jf.attention's calls (on a GPU also the Triton kernels by name, ``jaxforge-triton``: the
    default runs the forward in XLA's tiles until config.TRITON_MAX_SCORES_VALIDATED; on a Hopper
    the Mosaic GPU ones, ``jaxforge-mgpu``, the default's there once
    config.MOSAIC_MAX_SCORES_VALIDATED)."""

    def step(attend, with_max):  # a loss of the output; each head's largest logit (over batch and rows) as aux
        def loss(q, k, v):
            if not with_max:
                return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2), None
            out, top = attend(q, k, v, return_max_scores=True)
            return jnp.sum(out.astype(jnp.float32) ** 2), top.max(axis=(0, 1))

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)

    hopper = gpu and jax.devices()[0].compute_capability == "9.0"
    implementations = {"jaxforge": None} | ({"jaxforge-triton": "pallas_triton"} if gpu else {}) | ({"jaxforge-mgpu": "pallas_mosaic_gpu"} if hopper else {})
    variants = {}
    for name, implementation in implementations.items():
        attend = functools.partial(jf.attention, mask=mask, implementation=implementation)
        variants[("fwd", name)] = functools.partial(attend, return_max_scores=True)
        variants[("fwd+bwd", name)] = step(attend, True)
    attend = functools.partial(jf.attention, mask=mask)
    variants[("fwd", "jaxforge-no-max")] = lambda q, k, v: (attend(q, k, v),)
    variants[("fwd+bwd", "jaxforge-no-max")] = step(attend, False)
    return variants


def torch_variants(mask_name, dims):
    """Compiled FlexAttention's forward with and without the maxima, or {} without torch on CUDA."""
    try:
        import torch
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    b, sq, skv, hq, hkv, d, dv = dims
    block_mask = None
    if mask_name == "causal":
        block_mask = create_block_mask(lambda b, h, i, j: j <= i + skv - sq, None, None, sq, skv, device="cuda")
    flex = torch.compile(flex_attention)
    aux = AuxRequest(max_scores=True)

    def call(with_max):
        def run(q, k, v):
            kw = dict(block_mask=block_mask, enable_gqa=hq != hkv)
            with torch.no_grad():
                if with_max:
                    out, extra = flex(q, k, v, return_aux=aux, **kw)
                    return out, extra.max_scores.transpose(1, 2)
                return (flex(q, k, v, **kw),)

        return run

    return {("fwd", "torch-flex"): call(True), ("fwd", "torch-flex-no-max"): call(False)}


def _to_torch(x):
    import torch

    return torch.from_dlpack(x).transpose(1, 2).contiguous()  # (B, S, H, D) -> (B, H, S, D)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    if args.quick:
        cases = {"quick_causal": QUICK}
    else:
        names = args.shapes.split(",") if args.shapes else (GPU_SHAPES if gpu else CPU_SHAPES)
        cases = {name: SHAPES[name][:2] for name in names}
    records = []
    print(f"{'shape':18s} {'mode':8s} {'implementation':18s} {'median ms':>10s} {'ratio':>6s} {'max err':>9s}")
    for name, (dims, mask_name) in cases.items():
        q, k, v = _inputs(dims, dtype)
        want = reference_max_scores(q, k, mask_name == "causal")
        calls = {key: (jax.jit(fn), (q, k, v)) for key, fn in jax_variants(_mask(mask_name), gpu).items()}
        tensors = None
        for key, fn in torch_variants(mask_name, dims).items():
            tensors = tensors or tuple(_to_torch(x) for x in (q, k, v))
            calls[key] = (fn, tensors)
        results = {key: fn(*inputs) for key, (fn, inputs) in calls.items()}  # compiled, warmed up
        _block(results.values())
        times = {key: [] for key in calls}
        for _ in range(args.repeats):  # interleaved: this machine's drift falls on every call alike
            for key, (fn, inputs) in calls.items():
                start = time.perf_counter()
                _block([fn(*inputs)])
                times[key].append((time.perf_counter() - start) * 1e3)
        for (mode, impl), result in results.items():
            ours = float(np.median(times[(mode, "jaxforge")]))
            median = float(np.median(times[(mode, impl)]))
            error = _max_score_error(mode, result, want)
            print(f"{name:18s} {mode:8s} {impl:18s} {median:10.3f} {median / ours:6.2f} {'' if error is None else f'{error:9.2e}'}")
            records.append(dict(
                op="attention_max_scores", mode=mode, shape_name=name, shape=list(dims), mask=mask_name, status="ok",
                implementation=impl, median_ms=median, ratio=median / ours, times_ms=times[(mode, impl)],
                accuracy=None if error is None else {"max_scores": error},
            ))  # fmt: skip
    device = jax.devices()[0]
    kind = "h200" if "H200" in device.device_kind else "h100" if "H100" in device.device_kind else device.platform
    path = args.out / f"{datetime.date.today()}-{kind}-attention-max-scores{'-quick' if args.quick else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    run = dict(family="attention_max_scores", date=str(datetime.date.today()), device=kind, device_kind=device.device_kind,
               backend=jax.default_backend(), jax_version=jax.__version__, dtype=jnp.dtype(dtype).name, records=records)  # fmt: skip
    path.write_text(json.dumps(run, indent=1))
    print(f"wrote {path}")


def _block(results):
    for result in results:
        for x in jax.tree.leaves(result):
            if hasattr(x, "block_until_ready"):
                x.block_until_ready()
            else:  # a torch tensor: its stream
                import torch

                torch.cuda.synchronize()


def _max_score_error(mode, result, want):
    """Max abs error of a call's maxima (a forward's rows; a step's per-head maxima), None without."""
    if mode == "fwd":
        if len(result) < 2:
            return None
        top = np.asarray(result[1].float().cpu() if hasattr(result[1], "cpu") else result[1], np.float32)
        return float(np.max(np.abs(top - np.asarray(want))))
    per_head = result[1]
    return None if per_head is None else float(np.max(np.abs(np.asarray(per_head, np.float32) - np.asarray(want).max(axis=(0, 1)))))


if __name__ == "__main__":
    main()
