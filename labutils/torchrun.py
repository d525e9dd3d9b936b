"""Run a `launch`-style worker function under torchrun: the way to go multi-node. (Chapter 00.)

    torchrun --nproc-per-node 2 -m labutils.torchrun mypackage.mymodule:hello 10.0
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT --nproc-per-node 8 -m labutils.torchrun mod:fn

The function must live in an importable module (torchrun cannot receive a notebook cell; use
``%%writefile mymodule.py`` in the notebook). It is called exactly as `launch` calls it, ``fn(*args)``,
with torch.distributed already initialised from torchrun's environment (env://). Positional arguments
are parsed as Python literals when possible. Each rank prints ``result[RANK] = ...``; ``--out DIR`` also
saves each rank's return value to ``DIR/result_RANK.pkl`` (cloudpickle).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys

from .launcher.backend import choose


def init_from_env(backend: str = "auto") -> str:
    """Initialise torch.distributed from torchrun's environment variables; returns the backend (``"auto"``:
    NCCL when CUDA has a GPU for each local rank, else gloo; threads: this machine's cores over its ranks)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, threads = choose(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # as launch chooses
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method="env://", **kwargs)
    return backend


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}.torchrun", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="module:function")
    ap.add_argument("args", nargs="*", help="positional arguments (Python literals)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--out", help="folder to save each rank's return value")
    opts = ap.parse_args(argv)
    if ":" not in opts.target:
        ap.error(f"target must look like module:function, got {opts.target!r}")
    module_name, fn_name = opts.target.split(":", 1)
    sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(module_name), fn_name)
    init_from_env(opts.backend)
    import torch.distributed as dist

    try:
        result = fn(*[_literal(a) for a in opts.args])
        rank = dist.get_rank()
        print(f"result[{rank}] = {result!r}", flush=True)
        if opts.out:
            import cloudpickle

            os.makedirs(opts.out, exist_ok=True)
            with open(os.path.join(opts.out, f"result_{rank}.pkl"), "wb") as f:
                cloudpickle.dump(result, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
