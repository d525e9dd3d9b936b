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

from .functions import counts_list


class MOELinear(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ weight[e].T + bias[e]`` for every expert ``e``; weight ``(E, out, in)``."""

    @staticmethod
    def forward(ctx, x, counts, weight, bias):
        counts = counts_list(counts)
        if sum(counts) != x.shape[0]:
            raise ValueError(f"expert counts sum to {sum(counts)} but the buffer has {x.shape[0]} rows")
        out = x.new_empty(x.shape[0], weight.shape[1])                       # (N, out)
        biases = bias.unbind(0) if bias is not None else [None] * len(counts)
        # split/unbind make every expert's view in one call: x_e (n_e, in), out_e (n_e, out), w_e (out, in)
        for n, xe, oe, w, b in zip(counts, x.split(counts), out.split(counts), weight.unbind(0), biases):
            if n == 0:
                continue
            if b is None:
                torch.mm(xe, w.t(), out=oe)
            else:
                torch.addmm(b, xe, w.t(), out=oe)
        ctx.counts = counts
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        counts = ctx.counts
        grad_out = grad_out.contiguous()                                     # (N, out)
        need_x, _, need_w, need_b = ctx.needs_input_grad
        grad_x = x.new_empty(x.shape) if need_x else None                    # (N, in)
        grad_w = _empty_but_unused_zero(weight, counts) if need_w else None  # (E, out, in)
        grad_b = _empty_but_unused_zero(bias, counts) if (need_b and bias is not None) else None
        ones = grad_out.new_ones(max(counts, default=0))                     # bias grad as a BLAS mat-vec
        skip = [None] * len(counts)
        for n, g, xe, w, gx, gw, gb in zip(counts, grad_out.split(counts), x.split(counts), weight.unbind(0),
                                           grad_x.split(counts) if grad_x is not None else skip,
                                           grad_w.unbind(0) if grad_w is not None else skip,
                                           grad_b.unbind(0) if grad_b is not None else skip):
            if n == 0:
                continue
            if gx is not None:
                torch.mm(g, w, out=gx)                                       # (n, out) @ (out, in)
            if gw is not None:
                torch.mm(g.t(), xe, out=gw)                                  # (out, n) @ (n, in)
            if gb is not None:
                torch.mv(g.t(), ones[:n], out=gb)                            # (out, n) @ (n,)
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
        # fastmoe's: kaiming_uniform_(a=sqrt(5)) over the whole 3-D weight, whose fan-in torch computes as
        # out*in (dim 1 times the rest), so the bound is 1/sqrt(out*in), far below nn.Linear's 1/sqrt(in).
        # Bias zero, as in fastmoe. FMoETransformerMLP(init="linear") gives nn.Linear's bound instead.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, inp, fwd_expert_count):
        with torch.autocast(inp.device.type, enabled=False):  # in the weight's dtype, as fastmoe's kernel
            return MOELinear.apply(inp.to(self.weight.dtype), fwd_expert_count, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"num_expert={self.num_expert}, in_features={self.in_feat}, out_features={self.out_feat}, "
                f"bias={self.bias is not None}, rank={self.rank}")
