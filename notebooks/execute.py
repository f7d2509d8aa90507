"""Runs the notebooks in this folder top to bottom, in a fresh kernel on this very interpreter.

    python notebooks/execute.py [--write] [--timeout SECONDS] [NOTEBOOK ...]

Without NOTEBOOK arguments every ``notebooks/*.ipynb`` runs. A cell that raises fails its notebook
(the others still run; the exit status is 1). ``--write`` saves each notebook that ran cleanly back
in place with its outputs, so the plots show on the repository page; commit notebooks that way.

The kernel is ipykernel started with ``sys.executable`` (the interpreter running this script,
e.g. ``.venv/bin/python``), whatever ``python3`` kernel specs are installed for the user or
elsewhere, and it imports this checkout's jaxforge. Its working directory is the notebook's
folder, so notebooks read data by paths relative to ``notebooks/``.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import time
from pathlib import Path

import nbformat
import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets import default

__all__ = ["DEFAULT_TIMEOUT", "HERE", "execute", "main", "notebooks"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KERNEL_NAME = "python3"
DEFAULT_TIMEOUT = 300  # seconds per cell


class _ThisInterpreterSpecs(KernelSpecManager):
    """Resolves every kernel name to ipykernel's native spec for ``sys.executable``."""

    def get_kernel_spec(self, kernel_name, *args, **kwargs):
        from ipykernel.kernelspec import RESOURCES, get_kernel_dict

        return KernelSpec(name=kernel_name, resource_dir=RESOURCES, **get_kernel_dict())


class _ThisInterpreterKernelManager(AsyncKernelManager):
    @default("kernel_spec_manager")
    def _default_kernel_spec_manager(self):
        return _ThisInterpreterSpecs(parent=self)

    if "transport_encryption" in AsyncKernelManager.class_trait_names():  # jupyter_client >= 8.7

        @default("transport_encryption")
        def _default_transport_encryption(self):
            # CurveZMQ keys for the local sockets where pyzmq has them (and no plain-TCP warning)
            return "auto" if zmq.has("curve") else "disabled"


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    # this checkout's jaxforge first; inline figures even if the caller set another backend
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    return env


def notebooks() -> list[Path]:
    """Every notebook of this folder, in name order."""
    return sorted(HERE.glob("*.ipynb"))


def execute(path, *, write: bool = False, timeout: int = DEFAULT_TIMEOUT):
    """Executes the notebook at ``path`` and returns it (an ``nbformat`` node) with its outputs.

    Runs in a fresh ipykernel on ``sys.executable`` with the notebook's folder as working
    directory; ``timeout`` bounds each cell, in seconds. Raises ``nbclient.exceptions.
    CellExecutionError`` at the first cell that raises (nothing is written then). With ``write``
    the executed notebook replaces the file.
    """
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    options = {"coalesce_streams": True} if "coalesce_streams" in NotebookClient.class_trait_names() else {}
    client = NotebookClient(
        nb,
        timeout=math.ceil(timeout),  # nbclient wants whole seconds
        kernel_name=KERNEL_NAME,
        kernel_manager_class=_ThisInterpreterKernelManager,
        record_timing=False,  # no timestamps in the saved cells: re-running gives small diffs
        resources={"metadata": {"path": str(path.parent)}},
        **options,  # one output per run of printed lines (nbclient >= 0.10)
    )

    async def check_interpreter(notebook):
        """The kernel must run on this interpreter (asked of the kernel itself, before any cell)."""
        msg_id = client.kc.execute(
            "", silent=True, store_history=False, user_expressions={"exe": "__import__('sys').executable"}
        )
        reply = await client.async_wait_for_reply(msg_id)
        exe = ast.literal_eval(reply["content"]["user_expressions"]["exe"]["data"]["text/plain"])
        if Path(exe) != Path(sys.executable):
            raise RuntimeError(f"{path.name}: the kernel runs {exe}, not {sys.executable}")

    client.on_notebook_start = check_interpreter
    client.execute(env=_kernel_env())
    if write:
        nbformat.write(nb, path)
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument("--write", action="store_true", help="save each notebook in place with its outputs")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="seconds per cell (default %(default)s)")
    args = parser.parse_args(argv)
    paths = args.notebooks or notebooks()
    if not paths:
        print(f"no notebooks under {HERE}", file=sys.stderr)
        return 1
    failed = []
    for path in paths:
        start = time.perf_counter()
        try:
            execute(path, write=args.write, timeout=args.timeout)
        except Exception as err:  # report every notebook, then fail
            failed.append(path)
            print(f"FAILED {path.name} after {time.perf_counter() - start:.1f} s\n{err}", file=sys.stderr)
            continue
        size = f", {Path(path).stat().st_size / 1024:.0f} KiB written" if args.write else ""
        print(f"ok     {path.name}  {time.perf_counter() - start:.1f} s{size}", flush=True)
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {', '.join(p.name for p in failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
