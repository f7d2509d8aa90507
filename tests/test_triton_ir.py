"""tools/triton_ir.py reads the Triton kernels a call would run on a GPU, here without one: their
grids, products and loops follow the call's shape, and a kernel's IR does not depend on the batch
or the number of keys but through constants."""

import importlib
import re

import jax
import jax.numpy as jnp
import pytest

from jaxforge.functional.attention import Implementation


@pytest.fixture(scope="module")
def triton_ir():
    return importlib.import_module("tools.triton_ir")  # tools/ is no package: a namespace one from the root


def _lowered(triton_ir, dims, mode="fwd+bwd", **impl):
    fn, args = triton_ir.attention_call(dims, mode, jnp.bfloat16, Implementation("pallas_triton", kv_splits=1, **impl) if impl else None)
    return {k.name: k for k in triton_ir.kernels(fn, *args)}


def test_a_gradient_lowers_to_the_forward_and_both_backward_kernels(triton_ir):
    b, sq, skv, hq, hkv = 2, 40, 300, 8, 2
    kernels = _lowered(triton_ir, (b, sq, skv, hq, hkv, 64, 64))
    assert list(kernels) == ["jaxforge_attention_fwd", "jaxforge_attention_bwd_dq", "jaxforge_attention_bwd_dkv"]
    fwd, dq, dkv = kernels.values()
    # fwd and dq: a program per (item, query head, query tile); dkv per (item, kv head, key tile)
    assert fwd.grid[:2] == dq.grid[:2] == (b, hq) and dkv.grid[:2] == (b, hkv)
    assert fwd.grid[2] >= 1 and dkv.grid[2] >= 1
    # Per loop body (one for the tiles at the sequences' ends, one for the rest): fwd q·kᵀ and
    # p·v; dq the scores, g·vᵀ and ds·k; dkv those two and dsᵀ·q, pᵀ·g
    dots = [k.ops()["tt.dot"] for k in kernels.values()]
    assert dots == [4, 6, 8]
    assert "tt.load" in dkv.ir and "scf.for" in dkv.ir


def test_the_command_line_writes_each_kernel_and_compares_programs(triton_ir, tmp_path, capsys):
    dims = "2,1,256,8,2,64,64"
    assert triton_ir.main(["--dims", dims, "--out", str(tmp_path), "--against", "2,1,512,8,2,64,64"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"jaxforge_attention_{k}.ttir" for k in ("bwd_dkv", "bwd_dq", "fwd")]
    said = capsys.readouterr().out
    assert "jaxforge_attention_bwd_dkv: grid (2, 2, " in said and "4 dots" in said
    assert said.count("the same program") == 3
    assert triton_ir.main(["--dims", dims, "--against", "2,1,256,8,1,64,64"]) == 0  # one kv head: another dkv kernel
    assert "jaxforge_attention_bwd_dkv at 2,1,256,8,1,64,64: another program" in capsys.readouterr().out


def test_a_jvp_lowers_to_the_tangent_kernel(triton_ir):
    kernels = _lowered(triton_ir, (1, 32, 64, 4, 4, 32, 32), mode="jvp")
    assert "jaxforge_attention_tangent" in kernels


def test_the_decoding_backward_kernels_differ_between_shapes_only_in_constants(triton_ir):
    """The unpacked decoding backward (config.TRITON_UNPACKED_DECODING_BWD_VALIDATED) erred on the
    H200 at the bench's decode_gqa_8to1 (b 64, 8192 keys, GQA 32:4) and not at b 4, 2048 keys, 8:1.
    At b 4, 2048 keys, 32:4 its kernels are the bench's program but for the shape's numbers (at 8:1
    the dkv kernel differs: its one kv head folds the head's program id away), so whatever errs
    at the bench's shape and not at the small 32:4 on a GPU lies outside the lowering."""
    bench = _lowered(triton_ir, (64, 1, 8192, 32, 4, 128, 128), pack_gqa=False)
    small = _lowered(triton_ir, (4, 1, 2048, 32, 4, 128, 128), pack_gqa=False)
    for name in bench:
        assert bench[name].program() == small[name].program(), name
    assert bench["jaxforge_attention_bwd_dkv"].grid == (64, 4, 8192 // 64)


def test_mla_head_dims_lower_in_two_pieces(triton_ir):
    """MLA's absorbed decoding dims (576/512) held as 512 + 64 (Implementation.head_pieces): each
    product over q's and k's head dim is two MMAs, of 512 and 64 deep, where the padded kernels
    make one of 1024; products over v's 512 stay one. The jvp's tangent kernel, whose padded tiles
    fit no H200, lowers too."""
    dims = (2, 1, 256, 16, 1, 576, 512)
    pieces, padded = _lowered(triton_ir, dims, head_pieces=True), _lowered(triton_ir, dims, head_pieces=False)
    # fwd: q·kᵀ, p·v; dq: q·kᵀ, g·vᵀ, ds·k; dkv: those two and dsᵀ·q, pᵀ·g (one loop body each)
    assert [k.ops()["tt.dot"] for k in padded.values()] == [2, 3, 4]
    assert [k.ops()["tt.dot"] for k in pieces.values()] == [3, 5, 6]
    fwd = pieces["jaxforge_attention_fwd"].ir
    assert "tensor<16x512xbf16> * tensor<512x" in fwd and "tensor<16x64xbf16> * tensor<64x" in fwd
    assert "x1024xbf16>" in padded["jaxforge_attention_fwd"].ir and "x1024xbf16>" not in fwd
    # the rotary piece is read in place, at offset 512 of the operand's rows: the kernel takes k
    # whole, 576 wide (no copy of it is made, where the padded kernels take a 1024-wide one)
    assert "tt.make_range {end = 576 : i32, start = 512 : i32}" in fwd
    fn, args = triton_ir.attention_call(dims, "fwd", jnp.bfloat16, Implementation("pallas_triton", kv_splits=1, head_pieces=True))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (operands,) = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\((?:.*?)\) \{.*?\} : \((.*?)\) ->", text)
    assert re.findall(r"tensor<([\dx]+)xbf16>", operands) == ["2x16x1x576", "2x256x1x576", "2x256x1x512"]
    assert list(_lowered(triton_ir, dims, "jvp", head_pieces=True)) == ["jaxforge_attention_fwd", "jaxforge_attention_tangent"]


def test_head_dims_of_one_piece_lower_to_the_same_kernels_asked_for_pieces_or_not(triton_ir):
    """A power-of-two head dim is one piece: asking for pieces changes none of the kernels (the
    ones the H200 validated), forward, backward and tangent alike."""
    dims = (2, 40, 300, 8, 2, 128, 64)
    for mode in ("fwd+bwd", "jvp"):
        asked, not_asked = (_lowered(triton_ir, dims, mode, head_pieces=flag) for flag in (True, False))
        assert list(asked) == list(not_asked)
        assert all(asked[name].program() == not_asked[name].program() for name in asked)
