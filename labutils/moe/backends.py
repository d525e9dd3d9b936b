"""Expert backends, chosen by the machine: a loop of one matmul per expert, or one grouped GEMM. (Chapter 08.)

Both run ``x (N, a)`` whose rows are expert-contiguous (``counts[e]`` rows of expert e after those of e-1)
through stacked weights ``w (E, a, b)``, giving ``(N, b)``:

* ``loop``: ``x.split(counts)`` and one matmul per expert. The split sizes are read on the host, which on a GPU
  waits for the queued kernels (a synchronisation); on the CPU it is free and the loop is the fastest at the
  book's sizes (chapter 08's layer table).
* ``grouped``: ``torch._grouped_mm(x, w, offs=cumsum(counts))``, one call for all experts, the counts staying on
  the device. A private PyTorch op (2.8 and later): float32, bfloat16 or float16; rows and weight strides 16-byte
  aligned, on the CPU too (``a`` and ``b`` multiples of 4 in float32); rows past ``offs[-1]`` are not computed.

:func:`pick_backend` turns ``"auto"`` into one of them; ``FMoETransformerMLP(backend=...)`` and
``ModernMoE(impl=...)`` take the same three words.
"""
from __future__ import annotations

import torch

EXPERT_BACKENDS = ("auto", "loop", "grouped")


def grouped_mm_available() -> bool:
    """Whether this PyTorch has ``torch._grouped_mm`` (2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def pick_backend(backend: str, device, name: str = "backend") -> str:
    """``"loop"`` or ``"grouped"`` for ``backend`` (one of :data:`EXPERT_BACKENDS`; ``name``: the argument's name in the
    error) on ``device``.

    ``"auto"`` is ``"grouped"`` on a CUDA device when this PyTorch has ``torch._grouped_mm``, else ``"loop"``:
    the loop is the CPU's faster at the book's sizes (chapter 08), and on a GPU it costs a synchronisation per
    layer. (Which is faster on a GPU is measured by ``benchmarks/gpu_layer.py``, on a machine that has one.)"""
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"{name} must be one of {EXPERT_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "grouped" if torch.device(device).type == "cuda" and grouped_mm_available() else "loop"


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` ``(N, a)`` expert-contiguous, ``w`` ``(E, a, b)``, ``counts`` ``(E,)`` -> ``(N, b)``: one grouped GEMM."""
    if not grouped_mm_available():
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm; use the 'loop' backend")
    if x.dtype == torch.float32 and (x.shape[1] % 4 or w.shape[2] % 4):
        raise ValueError(f"torch._grouped_mm on float32 needs both widths to be multiples of 4 (16-byte strides), "
                         f"got {x.shape[1]} -> {w.shape[2]}")
    offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)     # (E,) end row of each expert
    return torch._grouped_mm(x.contiguous(), w, offs=offs)  # pyright: ignore[reportPrivateImportUsage]


def loop_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as :func:`grouped_matmul` with one matmul per expert (the reference; reads ``counts`` on the host)."""
    parts = x.split(counts.tolist())
    return torch.cat([p @ w[e] for e, p in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[2])
