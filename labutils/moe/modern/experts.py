"""Routed experts as stacked weights, run per expert (a loop of matmuls) or as one grouped GEMM.
(Taught in chapter 09.)

``w1`` ``(E, d, h)`` and ``w2`` ``(E, h, d)``: expert e maps ``x -> act(x @ w1[e]) @ w2[e]`` (no biases, as in
torchtitan's and DeepSeek-V3's experts; their experts are SwiGLU, the lab's keep chapter 05's GELU MLP).
The input is expert-contiguous: ``counts[e]`` rows of expert e after those of expert e-1.
``impl="grouped"`` calls ``torch._grouped_mm(x, w, offs=cumsum(counts))``: one call for all experts (a private
PyTorch op; on CPU, float32 needs ``d`` and ``h`` multiples of 4 for its 16-byte stride rule).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IMPLS = ("loop", "grouped")


def grouped_mm_available() -> bool:
    """Whether this PyTorch has ``torch._grouped_mm`` (2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` ``(N, a)`` expert-contiguous, ``w`` ``(E, a, b)``, ``counts`` ``(E,)`` -> ``(N, b)``: one grouped GEMM."""
    if not grouped_mm_available():
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm; use impl='loop'")
    if x.dtype == torch.float32 and (x.shape[1] % 4 or w.shape[2] % 4):
        raise ValueError(f"torch._grouped_mm on float32 needs both widths to be multiples of 4 (16-byte strides), "
                         f"got {x.shape[1]} -> {w.shape[2]}")
    offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)     # (E,) end row of each expert
    return torch._grouped_mm(x.contiguous(), w, offs=offs)  # pyright: ignore[reportPrivateImportUsage]


def loop_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as :func:`grouped_matmul` with one matmul per expert (the reference)."""
    parts = x.split(counts.tolist())
    return torch.cat([p @ w[e] for e, p in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[2])


class RoutedExperts(nn.Module):
    """``experts(x_sorted (N, d), counts (E,)) -> (N, d)``; ``impl`` ``"loop"`` or ``"grouped"``."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int, impl: str = "loop"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.num_experts, self.d_model, self.d_hidden, self.impl = num_experts, d_model, d_hidden, impl
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))   # (E, d, h)
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model))   # (E, h, d)
        with torch.no_grad():  # nn.Linear's bound 1/sqrt(fan_in), per expert
            self.w1.uniform_(-1 / math.sqrt(d_model), 1 / math.sqrt(d_model))
            self.w2.uniform_(-1 / math.sqrt(d_hidden), 1 / math.sqrt(d_hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if counts.shape != (self.num_experts,) or int(counts.sum()) != x.shape[0]:
            raise ValueError(f"counts must be ({self.num_experts},) summing to {x.shape[0]} rows, got "
                             f"{tuple(counts.shape)} summing to {int(counts.sum())}")
        mm = grouped_matmul if self.impl == "grouped" else loop_matmul
        return mm(F.gelu(mm(x, self.w1, counts)), self.w2, counts)          # (N, h) -> (N, d)
