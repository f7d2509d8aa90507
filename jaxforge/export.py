"""``jf.export``: save a function as serialized StableHLO and load it in another process.

    jf.export.save(fn, args, path)      # jax.export of jit(fn) at args' shapes, written atomically
    model = jf.export.load(path)        # checked, then model(*args) runs it

The file is ``MAGIC``, an 8-byte little-endian header length, a JSON header and the payload
that ``jax.export`` serializes (a flatbuffer). Loading parses only those: nothing is unpickled and
no code from the file runs on the host. It refuses a file that is not an artifact, is truncated or
altered (sha256 of the payload), or calls a custom call outside :data:`ALLOWED_CUSTOM_CALLS` and
jaxforge's own kernels; jaxforge's kernels an artifact needs are built and registered on load.
Pallas kernels (Triton, Mosaic GPU) travel as IR inside the module, which only the jax version
that wrote it is sure to read: such artifacts load under that version only.

``platforms=("cpu", "cuda")`` exports for both from any machine (the GPU lowerings need no GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import export as jax_export

from jaxforge import __version__
from jaxforge.functional.linalg import LstsqResult
from jaxforge.lowering import build

__all__ = ["ALLOWED_CUSTOM_CALLS", "VERSION_BOUND_CUSTOM_CALLS", "Artifact", "load", "save"]

MAGIC = b"JAXFORGE-EXPORT\n"
FORMAT = 1
_MAX_HEADER = 1 << 20

# Custom-call targets an artifact may use besides jaxforge's declared kernels: XLA's partitioning
# markers and the vendor libraries JAX itself lowers to (LAPACK, cuSOLVER, cuBLAS, Triton, Mosaic GPU).
ALLOWED_CUSTOM_CALLS = re.compile(
    r"(lapack_\w+|cusolver_\w+|cublas_\w+|cu_\w+|hipsolver_\w+|hipblas_\w+|hip_\w+"
    r"|Sharding|SPMDFullToShardShape|SPMDShardToFullShape|shape_assertion|annotate_device_placement"
    r"|__gpu\$xla\.gpu\.triton|mosaic_gpu(_v2)?)"
)
# Kernels compiled from IR embedded in the module (Pallas), and cuSOLVER's gesvdp (which the svd
# dispatch may pick): jax makes no promise that another jaxlib reads them the same way, so such
# artifacts load only under the jax version that saved them.
VERSION_BOUND_CUSTOM_CALLS = frozenset({"__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2", "cusolver_gesvdp_ffi"})
_CUSTOM_CALL = re.compile(r'custom_call @("[^"]+"|[\w.$]+)|call_target_name = "([^"]+)"')

jax_export.register_namedtuple_serialization(LstsqResult, serialized_name="jaxforge.LstsqResult")


def _kernel_targets() -> dict[str, build.Kernel]:
    return {target: kernel for kernel in build.declared_kernels().values() for target in kernel.targets}


def custom_call_targets(exported: jax_export.Exported) -> list[str]:
    """Every custom-call target the exported module calls, sorted."""
    found = {quoted.strip('"') or named for quoted, named in _CUSTOM_CALL.findall(exported.mlir_module())}
    return sorted(found)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A loaded function: call it like the original (same argument pytree, shapes and dtypes).

    A function exported across ``n`` devices (a ``jf.shard`` inside, or arguments placed on a mesh)
    runs on this process's first ``n``: on a mesh of the saved one's axes where the arguments were
    placed on one (their shardings are the export's), else with its arguments replicated there
    (the module lays them out itself)."""

    exported: jax_export.Exported
    header: dict

    def __call__(self, *args):
        return self._call(*args)

    @functools.cached_property
    def _call(self) -> Callable:
        exported, n = self.exported, self.exported.nr_devices
        if n == 1:
            return exported.call
        if jax.device_count() < n:
            raise ValueError(f"export: this function was exported for {n} devices; this process has {jax.device_count()}")
        saved = self.header.get("mesh")
        if saved is None:
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("devices",))
            shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * len(exported.in_avals)
        else:
            types = tuple(jax.sharding.AxisType[t] for t in saved["axis_types"])
            mesh = jax.make_mesh(tuple(saved["axis_sizes"]), tuple(saved["axis_names"]), axis_types=types, devices=jax.devices()[:n])
            shardings = exported.in_shardings_jax(mesh)
        args, _ = jax.tree.unflatten(exported.in_tree, shardings)  # save() passes no kwargs
        return jax.jit(exported.call, in_shardings=args)


def save(fn: Callable, args: Sequence, path: str | os.PathLike, *, platforms: Sequence[str] | None = None) -> Artifact:
    """Exports ``jax.jit(fn)`` at the shapes of ``args`` (arrays or ``jax.ShapeDtypeStruct``, symbolic
    dims allowed) for ``platforms`` (default: this backend) and writes it to ``path`` atomically."""
    if not callable(fn):
        raise TypeError(f"export.save: `fn` must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"export.save: `args` must be a tuple or list of fn's arguments, got {type(args).__name__}")
    ours = [jax_export.DisabledSafetyCheck.custom_call(t) for t in (*_kernel_targets(), *VERSION_BOUND_CUSTOM_CALLS)]
    exported = jax_export.export(jax.jit(fn), platforms=platforms, disabled_checks=ours)(*args)
    _refuse_unknown_targets(custom_call_targets(exported), str(path))
    header = _write(exported, _mesh_of(args), pathlib.Path(path))
    return Artifact(exported, header)


def _mesh_of(args) -> dict | None:
    """The mesh the arguments are placed on (its axes, for load to rebuild), or None."""
    meshes = {leaf.sharding.mesh for leaf in jax.tree.leaves(args) if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)}
    meshes = {m for m in meshes if m.size > 1}
    if len(meshes) > 1:
        raise ValueError(f"export.save: the arguments are placed on {len(meshes)} different meshes; place them on one")
    if not meshes:
        return None
    (mesh,) = meshes
    return {"axis_names": list(mesh.axis_names), "axis_sizes": list(mesh.axis_sizes), "axis_types": [t.name for t in mesh.axis_types]}


def load(path: str | os.PathLike) -> Artifact:
    """Reads, verifies and deserializes an artifact written by :func:`save`; raises ``ValueError``
    naming the file and the reason if it is not one, is damaged, or calls unknown custom calls."""
    path = pathlib.Path(path)
    raw = path.read_bytes()
    header, payload = _parse(raw, path)
    try:
        exported = jax_export.deserialize(bytearray(payload))
    except Exception as error:  # the flatbuffer parser's own errors vary by version
        raise ValueError(f"export.load: {path} is corrupted: its payload does not deserialize ({error})") from None
    targets = custom_call_targets(exported)
    if targets != header["custom_calls"]:
        raise ValueError(f"export.load: {path} is corrupted: its header lists custom calls {header['custom_calls']}, the module {targets}")
    _refuse_unknown_targets(targets, str(path))
    bound = sorted(VERSION_BOUND_CUSTOM_CALLS.intersection(targets))
    if bound and header.get("jax") != jax.__version__:
        raise ValueError(
            f"export.load: {path} holds kernels compiled from embedded IR ({bound}) by jax {header.get('jax')}; "
            f"this is jax {jax.__version__}, which may not read it: export it again with this version"
        )
    kernels = _kernel_targets()
    for target in targets:
        if target in kernels and not build.ensure_loaded(kernels[target]):
            raise ValueError(f"export.load: {path} calls the jaxforge kernel {target!r}, which cannot be built on this machine")
    return Artifact(exported, header)


def _refuse_unknown_targets(targets: list[str], where: str) -> None:
    kernels = _kernel_targets()
    unknown = [t for t in targets if t not in kernels and not ALLOWED_CUSTOM_CALLS.fullmatch(t)]
    if unknown:
        raise ValueError(
            f"export: {where} calls unknown custom-call targets {unknown}; an artifact may call only "
            f"jaxforge's kernels {sorted(kernels)} and the targets ALLOWED_CUSTOM_CALLS matches"
        )


def _write(exported: jax_export.Exported, mesh: dict | None, path: pathlib.Path) -> dict:
    payload = bytes(exported.serialize())
    header = {
        "format": FORMAT,
        "jaxforge": __version__,
        "jax": jax.__version__,
        "platforms": list(exported.platforms),
        "in_avals": [str(a) for a in exported.in_avals],
        "out_avals": [str(a) for a in exported.out_avals],
        "custom_calls": custom_call_targets(exported),
        "mesh": mesh,
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    encoded = json.dumps(header, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(MAGIC + len(encoded).to_bytes(8, "little") + encoded + payload)
    os.replace(tmp.name, path)
    return header


def _parse(raw: bytes, path: pathlib.Path) -> tuple[dict, bytes]:
    if not raw.startswith(MAGIC):
        raise ValueError(f"export.load: {path} is not a jaxforge export (it does not start with {MAGIC!r})")
    start = len(MAGIC) + 8
    size = int.from_bytes(raw[len(MAGIC) : start], "little")
    if size > min(_MAX_HEADER, len(raw) - start):
        raise ValueError(f"export.load: {path} is corrupted or truncated: header of {size} bytes in a {len(raw)}-byte file")
    try:
        header = json.loads(raw[start : start + size])
        expected = (header["format"], header["payload_bytes"], header["payload_sha256"], header["custom_calls"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"export.load: {path} is corrupted: its header is not valid") from None
    if expected[0] != FORMAT:
        raise ValueError(f"export.load: {path} has format {expected[0]!r}; this jaxforge reads format {FORMAT}")
    payload = raw[start + size :]
    if len(payload) != expected[1] or hashlib.sha256(payload).hexdigest() != expected[2]:
        raise ValueError(f"export.load: {path} is corrupted: its payload does not match the sha256 in its header")
    if not _valid_mesh(header.get("mesh")):
        raise ValueError(f"export.load: {path} is corrupted: its header's mesh {header['mesh']!r} is not valid")
    return header, payload


def _valid_mesh(mesh) -> bool:
    """Whether a header's ``mesh`` is None or what :func:`_mesh_of` writes: equal-length lists of
    axis names, positive sizes and AxisType names."""
    if mesh is None:
        return True
    if not isinstance(mesh, dict):
        return False
    names, sizes, types = (mesh.get(key) for key in ("axis_names", "axis_sizes", "axis_types"))
    return (
        all(isinstance(axes, list) for axes in (names, sizes, types))
        and len(names) == len(sizes) == len(types)
        and all(isinstance(name, str) for name in names)
        and all(isinstance(size, int) and size > 0 for size in sizes)
        and all(t in jax.sharding.AxisType.__members__ for t in types)
    )
