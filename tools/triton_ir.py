"""The Triton IR of the attention kernels a call would run on a GPU, lowered on any machine.

A Pallas Triton kernel is lowered to Triton IR by jax when the call is lowered for "cuda"
(``lowering_platforms``), GPU or not: each ``pallas_call`` becomes a custom call whose backend
config holds the kernel's IR as MLIR bytecode, with its grid, warps and stages. This prints a line
per kernel and writes each kernel's IR, as text, to ``--out``: to read a kernel's addressing, loops
and products without a GPU, or to diff the kernels of two shapes (where one errs on a GPU and the
other does not, identical IR up to the shape's constants puts the fault outside the lowering)::

    PYTHONPATH=. python tools/triton_ir.py --dims 64,1,8192,32,4,128,128 --mode fwd+bwd --out /tmp/ir
    PYTHONPATH=. python tools/triton_ir.py --dims 64,1,8192,32,4,128,128 --against 4,1,2048,8,1,128,128
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.interpreters import mlir
from jaxlib.triton import dialect as triton_dialect

import jaxforge as jf
from jaxforge.functional.attention import Implementation

MODES = ("fwd", "fwd+bwd", "jvp")


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    ir: str  # the kernel's Triton IR, as text

    def program(self) -> str:
        """The IR with its integer constants, value names and locations blanked: two kernels with
        one program differ in nothing else (tile shapes stay: they are types)."""
        ir = re.sub(r"loc\([^)]*\)|#loc\d*( = .*)?", "", self.ir)
        ir = re.sub(r"%[\w#:]+", "%", ir)
        return re.sub(r"\b\d+\b", "N", ir)

    def ops(self) -> collections.Counter:
        """How many of each Triton / arith / scf operation the kernel's IR holds."""
        return collections.Counter(re.findall(r"\b((?:tt|arith|scf)\.\w+)", self.ir))


def kernels(fn, *args) -> list[Kernel]:
    """The Pallas Triton kernels of ``jax.jit(fn)(*args)`` lowered for "cuda" (``args`` may be
    ``jax.ShapeDtypeStruct``\\ s), in program order."""
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    triton_dialect.register_dialect(module.context)  # the kernels' "tt" ops, which lowering alone may leave unregistered
    found = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    config = inner.attributes["mhlo.backend_config"] if "mhlo.backend_config" in inner.attributes else None
                    if inner.operation.name == "stablehlo.custom_call" and isinstance(config, mlir.ir.DictAttr) and "ir" in config:
                        found.append(_kernel(config, module.context))
                    visit(inner.operation)

    visit(module.operation)
    return found


def _kernel(config, context) -> Kernel:
    integer = lambda key: mlir.ir.IntegerAttr(config[key]).value  # noqa: E731
    ir = mlir.ir.Module.parse(mlir.ir.StringAttr(config["ir"]).value_bytes, context=context)
    return Kernel(
        mlir.ir.StringAttr(config["name"]).value,
        (integer("grid_x"), integer("grid_y"), integer("grid_z")),
        integer("num_warps"),
        integer("num_stages"),
        str(ir),
    )


def attention_call(dims, mode: str, dtype=jnp.bfloat16, implementation: Implementation | None = None):
    """``(fn, args)``: ``mode`` ("fwd", "fwd+bwd", "jvp") of ``jf.attention`` at ``dims = (b, sq,
    skv, hq, hkv, d, dv)`` (the bench's layout) in ``dtype``, on ``implementation`` (the Triton
    kernels unpacked and unsplit by default)."""
    b, sq, skv, hq, hkv, d, dv = dims
    impl = implementation or Implementation("pallas_triton", pack_gqa=False, kv_splits=1)
    q, k, v, g = (jax.ShapeDtypeStruct(s, dtype) for s in ((b, sq, hq, d), (b, skv, hkv, d), (b, skv, hkv, dv), (b, sq, hq, dv)))
    attend = lambda q, k, v: jf.attention(q, k, v, implementation=impl)  # noqa: E731
    if mode == "fwd":
        return attend, (q, k, v)
    if mode == "jvp":
        return (lambda q, k, v, dq, dk, dv: jax.jvp(attend, (q, k, v), (dq, dk, dv))), (q, k, v, q, k, v)
    loss = lambda q, k, v, g: jnp.sum(attend(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, (0, 1, 2)), (q, k, v, g)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", required=True, help="b,sq,skv,hq,hkv,d,dv")
    parser.add_argument("--mode", choices=MODES, default="fwd+bwd")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--pack-gqa", action="store_true", help="pack each GQA group's query heads into one tile")
    parser.add_argument("--kv-splits", type=int, default=1)
    parser.add_argument("--head-pieces", action="store_true", help="hold head dims that are no power of two in two pieces")
    parser.add_argument("--out", help="a folder for one <kernel>.ttir a kernel")
    parser.add_argument("--against", help="b,sq,skv,hq,hkv,d,dv: say which kernels are the same program at these dims")
    args = parser.parse_args(argv)
    impl = Implementation("pallas_triton", pack_gqa=args.pack_gqa, kv_splits=args.kv_splits, head_pieces=args.head_pieces)

    def lowered(text: str, flag: str) -> list[Kernel]:
        dims = tuple(int(x) for x in text.split(","))
        if len(dims) != 7:
            parser.error(f"{flag} takes 7 integers b,sq,skv,hq,hkv,d,dv; got {text!r}")
        fn, call_args = attention_call(dims, args.mode, jnp.dtype(args.dtype), impl)
        return kernels(fn, *call_args)

    found = lowered(args.dims, "--dims")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for kernel in found:
        ops = kernel.ops()
        print(f"{kernel.name}: grid {kernel.grid}, {kernel.num_warps} warps, {kernel.num_stages} stages, "
              f"{ops['tt.dot']} dots, {ops['tt.load']} loads, {ops['tt.store']} stores, {ops['scf.for']} loops")
        if args.out:
            with open(os.path.join(args.out, f"{kernel.name}.ttir"), "w") as f:
                f.write(kernel.ir)
    if args.against:
        others = {k.name: k for k in lowered(args.against, "--against")}
        for kernel in found:
            other = others.get(kernel.name)
            same = other is not None and other.program() == kernel.program()
            print(f"{kernel.name} at {args.against}: {'the same program' if same else 'another program' if other else 'absent'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
