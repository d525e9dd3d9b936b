"""Shared (always-on) experts: DeepSeekMoE's experts every token passes through. (Taught in chapter 09.)

``n`` shared experts of width ``h`` summed are ONE MLP of width ``n * h`` (the hidden units just concatenate),
which is how DeepSeek-V3 and torchtitan build them (one FeedForward of ``n * h``). :meth:`as_experts` splits
the weights back into the ``n`` experts, so the identity is checked rather than assumed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SharedExperts(nn.Module):
    """``n_shared`` always-on GELU experts of width ``d_hidden``, stored as one ``(d, n*h)`` / ``(n*h, d)`` MLP."""

    def __init__(self, n_shared: int, d_model: int, d_hidden: int):
        super().__init__()
        if n_shared < 1:
            raise ValueError(f"n_shared must be >= 1, got {n_shared}")
        self.n_shared, self.d_hidden = n_shared, d_hidden
        width = n_shared * d_hidden
        self.w1 = nn.Parameter(torch.empty(d_model, width).uniform_(-1, 1) / math.sqrt(d_model))  # (d, n h)
        self.w2 = nn.Parameter(torch.empty(width, d_model).uniform_(-1, 1) / math.sqrt(d_hidden))  # (n h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:           # (..., d)
        return F.gelu(x @ self.w1) @ self.w2                       # (..., d)

    def as_experts(self):
        """The ``n_shared`` experts as ``[(w1_i (d, h), w2_i (h, d))]`` views of the fused weights."""
        h = self.d_hidden
        return [(self.w1[:, i * h:(i + 1) * h], self.w2[i * h:(i + 1) * h]) for i in range(self.n_shared)]
