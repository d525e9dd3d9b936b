"""Routed experts as stacked weights, run per expert (a loop of matmuls) or as one grouped GEMM.
(Taught in chapter 09.)

``w1`` ``(E, h, d)`` and ``w2`` ``(E, d, h)``, fastmoe's ``(E, out, in)`` layout (the lab's one stacked-weight
layout): expert e maps ``x -> act(x @ w1[e].T) @ w2[e].T`` (no biases, as in torchtitan's and DeepSeek-V3's
experts; their experts are SwiGLU, the lab's keep chapter 05's GELU MLP). The input is expert-contiguous:
``counts[e]`` rows of expert e after those of expert e-1. ``impl``: ``"auto"``, ``"loop"`` or ``"grouped"``
(:mod:`labutils.moe.backends`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..._deprecate import forward_moved
from ..backends import grouped_matmul, loop_matmul, pick_backend
from ..device_path import on_device_path

__all__ = ["RoutedExperts"]
forward_moved(__name__)  # the backends' old address (labutils.moe.backends since 0.3.0)


class RoutedExperts(nn.Module):
    """``experts(x_sorted (N, d), counts (E,)) -> (N, d)``; ``impl`` ``"auto"``, ``"loop"`` or ``"grouped"``."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int, impl: str = "auto"):
        super().__init__()
        pick_backend(impl, "cpu", "impl")                                      # refuses an unknown impl
        self.num_experts, self.d_model, self.d_hidden, self.impl = num_experts, d_model, d_hidden, impl
        # Drawn as (E, in, out), the order of labutils <= 0.3.0, so a seed gives the same experts as before.
        w1 = torch.empty(num_experts, d_model, d_hidden).uniform_(-1 / math.sqrt(d_model), 1 / math.sqrt(d_model))
        w2 = torch.empty(num_experts, d_hidden, d_model).uniform_(-1 / math.sqrt(d_hidden), 1 / math.sqrt(d_hidden))
        self.w1 = nn.Parameter(w1.transpose(1, 2).contiguous())               # (E, h, d)
        self.w2 = nn.Parameter(w2.transpose(1, 2).contiguous())               # (E, d, h)

    def backend(self, device) -> str:
        """``"loop"`` or ``"grouped"``: what ``impl`` means on ``device``."""
        return pick_backend(self.impl, device, "impl")

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts must be ({self.num_experts},), got {tuple(counts.shape)}")
        if not on_device_path() and int(counts.sum()) != x.shape[0]:   # on the device path rows past the sum
            raise ValueError(f"counts must be ({self.num_experts},) summing to {x.shape[0]} rows, got "  # are dropped
                             f"{tuple(counts.shape)} summing to {int(counts.sum())}")
        mm = grouped_matmul if self.backend(x.device) == "grouped" else loop_matmul
        return mm(F.gelu(mm(x, self.w1.transpose(1, 2), counts)), self.w2.transpose(1, 2), counts)  # (N, h), (N, d)
