"""Where the ranks of a launch run: the backend and the torch threads per rank, chosen in one place for
``launch`` and ``python -m labutils.torchrun``. (Taught in chapter 00.)"""
from __future__ import annotations

import os

BACKENDS = ("gloo", "nccl")


def default_backend(world_size: int) -> str:
    """NCCL when CUDA has a GPU for each of the ``world_size`` ranks on this machine, else gloo."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def threads_per_rank(world_size: int) -> int:
    """The usable cores of this machine shared among its ``world_size`` ranks, at least 1 each."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def choose(backend: str, world_size: int, threads: int | None = None) -> tuple[str, int]:
    """``(backend, threads)`` for ``world_size`` ranks on this machine: ``backend="auto"`` picks
    :func:`default_backend`, ``threads=None`` :func:`threads_per_rank`; ``"nccl"`` without CUDA is refused."""
    backend = default_backend(world_size) if backend == "auto" else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA GPUs; none is available here (use backend='gloo')")
    return backend, threads or threads_per_rank(world_size)
