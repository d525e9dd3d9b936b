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
        gpus = torch.cuda.device_count()
        if gpus < world_size:  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") only once they start
            raise ValueError(f"launch(world_size={world_size}, backend='nccl') needs one GPU per rank: {world_size} "
                             f"ranks but torch.cuda.device_count() = {gpus} GPU(s) visible; use backend='gloo' "
                             f"(CPU) or world_size <= {gpus}")
    return backend, threads or threads_per_rank(world_size)


def gpu_or_cpu(world_size: int) -> tuple[str, str, str]:
    """``(backend, device type, why)`` for a chapter cell that would run ``world_size`` ranks on GPUs: NCCL on
    CUDA when there is a GPU per rank, else gloo on the CPU, and a sentence saying which and why (print it).
    Every CUDA cell of the book asks this first, so a machine with fewer GPUs than ranks runs the cell on the
    CPU instead of waiting in NCCL's setup until the launch times out."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world_size:
        return "nccl", "cuda", f"NCCL on CUDA: {gpus} GPU(s) visible for {world_size} rank(s)"
    return "gloo", "cpu", (f"gloo on the CPU: {gpus} CUDA GPU(s) visible, {world_size} rank(s) need {world_size}"
                           if gpus else f"gloo on the CPU: no CUDA GPU visible ({world_size} rank(s))")
