"""FMoETransformerMLP: the MoE feed-forward block of a transformer. (Taught in chapter 01.)

fastmoe's defaults (32 experts, d_model 1024, d_hidden 4096) give about 268M parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import FMoE
from .linear import FMoELinear


class _Expert(nn.Module):
    """``num_expert`` two-layer MLPs fused into two FMoELinear: d_model -> d_hidden -> activation -> d_model."""

    def __init__(self, num_expert: int, d_model: int, d_hidden: int, activation, rank: int = 0):
        super().__init__()
        self.htoh4 = FMoELinear(num_expert, d_model, d_hidden, bias=True, rank=rank)
        self.h4toh = FMoELinear(num_expert, d_hidden, d_model, bias=True, rank=rank)
        self.activation = activation

    def forward(self, inp, fwd_expert_count):
        counts = fwd_expert_count.tolist() if torch.is_tensor(fwd_expert_count) else fwd_expert_count
        x = self.htoh4(inp, counts)                                           # (N, d_hidden)
        x = self.activation(x)
        return self.h4toh(x, counts)                                          # (N, d_model)


class FMoETransformerMLP(FMoE):
    """An MoE MLP: ``FMoE`` whose experts are fused two-layer MLPs (weights ``experts.htoh4.weight`` (E, h, d)).

    Keyword arguments of :class:`FMoE` (``top_k``, ``gate``, ``world_size``, ``gate_hook``, ...) pass through.
    """

    def __init__(self, num_expert: int = 32, d_model: int = 1024, d_hidden: int = 4096,
                 activation=torch.nn.GELU(), expert_dp_comm: str = "none", expert_rank: int = 0, **kwargs):
        super().__init__(num_expert=num_expert, d_model=d_model, **kwargs)
        self.d_hidden = d_hidden
        self.experts = _Expert(num_expert, d_model, d_hidden, activation, rank=expert_rank)
        self.mark_parallel_comm(expert_dp_comm)
