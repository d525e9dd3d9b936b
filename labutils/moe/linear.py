"""FMoELinear: ``E`` linear layers applied to an expert-contiguous buffer. (Taught in chapter 01.)

fastmoe runs this as one CUDA kernel per direction. On CPU the fastest plain-PyTorch form is one BLAS
matmul per expert written straight into a preallocated output (``torch.mm(..., out=)``), wrapped in an
autograd Function so the backward is also one matmul per expert and per gradient, with no per-expert
autograd nodes, no ``torch.cat`` and no full-size zero gradient per weight slice.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _as_list(counts) -> list:
    return counts.tolist() if torch.is_tensor(counts) else [int(c) for c in counts]


def _segments(counts: list):
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


class MOELinear(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ weight[e].T + bias[e]`` for every expert ``e``; weight ``(E, out, in)``."""

    @staticmethod
    def forward(ctx, x, counts, weight, bias):
        counts = _as_list(counts)
        if sum(counts) != x.shape[0]:
            raise ValueError(f"expert counts sum to {sum(counts)} but the buffer has {x.shape[0]} rows")
        out = x.new_empty(x.shape[0], weight.shape[1])                       # (N, out)
        for e, a, b in _segments(counts):
            if bias is None:
                torch.mm(x[a:b], weight[e].t(), out=out[a:b])
            else:
                torch.addmm(bias[e], x[a:b], weight[e].t(), out=out[a:b])
        ctx.counts = counts
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_out = grad_out.contiguous()                                     # (N, out)
        need_x, _, need_w, need_b = ctx.needs_input_grad
        grad_x = x.new_empty(x.shape) if need_x else None                    # (N, in)
        grad_w = _empty_but_unused_zero(weight, ctx.counts) if need_w else None  # (E, out, in)
        grad_b = _empty_but_unused_zero(bias, ctx.counts) if (need_b and bias is not None) else None
        ones = grad_out.new_ones(max(ctx.counts, default=0))                 # bias grad as a BLAS mat-vec
        for e, a, b in _segments(ctx.counts):
            g = grad_out[a:b]
            if grad_x is not None:
                torch.mm(g, weight[e], out=grad_x[a:b])
            if grad_w is not None:
                torch.mm(g.t(), x[a:b], out=grad_w[e])
            if grad_b is not None:
                torch.mv(g.t(), ones[: b - a], out=grad_b[e])
        return grad_x, None, grad_w, grad_b


def _empty_but_unused_zero(param: torch.Tensor, counts: list) -> torch.Tensor:
    """A gradient buffer for ``param`` (E, ...): every expert's slice is overwritten, so only experts that
    got no rows need zeros (a full ``zeros_like`` would be a needless pass over the weights)."""
    grad = torch.empty_like(param)
    for e, n in enumerate(counts):
        if n == 0:
            grad[e].zero_()
    return grad


class FMoELinear(nn.Module):
    """``num_expert`` linear layers in one module: weight ``(E, out_feat, in_feat)``, bias ``(E, out_feat)``.

    ``forward(inp, fwd_expert_count)``: ``inp`` is an expert-contiguous ``(N, in_feat)`` buffer whose first
    ``fwd_expert_count[0]`` rows go to expert 0, and so on.
    """

    def __init__(self, num_expert: int, in_feat: int, out_feat: int, bias: bool = True, rank: int = 0):
        super().__init__()
        self.num_expert, self.in_feat, self.out_feat, self.rank = num_expert, in_feat, out_feat, rank
        self.weight = nn.Parameter(torch.empty(num_expert, out_feat, in_feat))
        self.bias = nn.Parameter(torch.zeros(num_expert, out_feat)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # like nn.Linear PER EXPERT (bound 1/sqrt(in_feat)); bias zero as in fastmoe. fastmoe applies
        # kaiming_uniform_ to the whole 3-D tensor, whose fan-in is out*in: far smaller weights.
        bound = 1.0 / math.sqrt(self.in_feat)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, inp, fwd_expert_count):
        return MOELinear.apply(inp.to(self.weight.dtype), fwd_expert_count, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"num_expert={self.num_expert}, in_features={self.in_feat}, out_features={self.out_feat}, "
                f"bias={self.bias is not None}, rank={self.rank}")
