"""The experts' fast paths: every expert's Linear -> activation -> Linear in one autograd Function (the loop
backend), or as two grouped GEMMs (the grouped backend, :func:`grouped_expert_mlps`).
(Taught in chapter 01; measured in chapter 08 and ``benchmarks/moe_layer.py``.)

``FMoETransformerMLP`` stores its experts as fastmoe >= 1.0.1 does, one ``_Expert`` module each
(``experts.<i>.htoh4.weight`` of shape ``(1, d_hidden, d_model)``). Running them one module at a time through
autograd works (that is ``FMoE.expert_fn``'s generic loop) but costs a graph of ~6 nodes per expert; one
Function does every expert's two matmuls and activation forward, and every gradient backward, directly.

Why per-expert tensors, all the way down: with glibc's default allocator, any block above its mmap threshold
(dynamic, at most 32 MB) is a fresh ``mmap`` whose pages fault in on first touch, on every step. A fused
``(E, out, in)`` weight gradient, or one ``(N, d_hidden)`` activation buffer for all experts, crosses it at
book sizes; per-expert gradients and activations (``n_e x d_hidden``) stay below it and are reused from the
heap. ``benchmarks/moe_layer.py`` measures the difference.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .backends import grouped_matmul

_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.ReLU6, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU,
                nn.Mish, nn.Softplus, nn.Hardswish, nn.Hardtanh, nn.Identity)
_ELEMENTWISE_FNS = {F.gelu, F.relu, F.silu, F.mish, F.elu, F.leaky_relu, F.softplus, torch.relu, torch.tanh,
                    torch.sigmoid, F.tanh, F.sigmoid}


_GELU_BACKWARD = torch.ops.aten.gelu_backward.default


def fusable_activation(activation) -> bool:
    """True for a deterministic elementwise activation the fast path can run: one of ``nn.GELU``, ``nn.ReLU``,
    ``nn.SiLU``, ``nn.Tanh``, ... (or ``F.gelu``, ``torch.relu``, ...), an ``nn.Sequential`` of them, or a
    ``Dropout`` that is off (eval mode or ``p=0``). The backward recomputes the activation, so anything random
    (Dropout in training: it would draw a new mask) or unknown runs through autograd instead."""
    if isinstance(activation, nn.Sequential):
        return all(fusable_activation(m) for m in activation)
    if isinstance(activation, nn.modules.dropout._DropoutNd):
        return not activation.training or activation.p == 0
    if isinstance(activation, nn.Module):
        return isinstance(activation, _ELEMENTWISE)
    return activation in _ELEMENTWISE_FNS


def _activation_grad(activation, pre: torch.Tensor, grad_post: torch.Tensor) -> torch.Tensor:
    """d loss / d pre-activation, for ``post = activation(pre)``."""
    if isinstance(activation, nn.GELU):
        return _GELU_BACKWARD(grad_post, pre, approximate=activation.approximate)
    with torch.enable_grad():
        leaf = pre.detach().requires_grad_()
        (grad_pre,) = torch.autograd.grad(activation(leaf), leaf, grad_post)
    return grad_pre


class ExpertMLPs(torch.autograd.Function):
    """``y[rows of e] = act(x[rows of e] @ w1[e].T + b1[e]) @ w2[e].T + b2[e]`` for every expert ``e``.

    ``params`` are ``E`` tensors each of ``w1 (1, h, d)``, ``b1 (1, h)``, ``w2 (1, d, h)``, ``b2 (1, d)`` in that
    order: the experts' parameters as stored, so no view is recorded by autograd. Every intermediate is per
    expert (``(n_e, h)``); only ``x``, ``y`` and ``grad_x`` span all rows.
    """

    @staticmethod
    def forward(ctx, x, counts: list, activation, *params):                 # x: (N, d) expert-contiguous
        E = len(counts)
        w1, b1, w2, b2 = ([p[0] for p in params[i * E:(i + 1) * E]] for i in range(4))  # 2-D views, made once
        act = _plain_call(activation)
        out = x.new_empty(x.shape[0], w2[0].shape[0])                        # (N, d)
        saved = []
        for n, xe, oe, w1e, b1e, w2e, b2e in zip(counts, x.split(counts), out.split(counts), w1, b1, w2, b2):
            if n == 0:
                saved.append(None)
                continue
            pre = torch.addmm(b1e, xe, w1e.t())                             # (n_e, h)
            post = act(pre)                                                 # (n_e, h)
            torch.addmm(b2e, post, w2e.t(), out=oe)                         # (n_e, d)
            saved.append((pre, post))
        ctx.counts, ctx.activation, ctx.hidden, ctx.weights = counts, activation, saved, (w1, w2)
        ctx.save_for_backward(x, *params)  # params saved too: autograd checks they were not changed in place
        return out

    @staticmethod
    def backward(ctx, grad_out):                                            # (N, d)
        x, *params = ctx.saved_tensors
        counts, act, E = ctx.counts, ctx.activation, len(ctx.counts)
        w1, w2 = ctx.weights                                                # E views each: (h, d), (d, h)
        grad_out = grad_out.contiguous()
        grad_x = x.new_empty(x.shape)                                       # (N, d)
        grads: list = [None] * (4 * E)
        rows = zip(counts, grad_out.split(counts), x.split(counts), grad_x.split(counts), ctx.hidden, w1, w2)
        for e, (n, g, xe, gx, hidden, w1e, w2e) in enumerate(rows):
            if n == 0:
                grads[e::E] = [torch.zeros_like(params[i * E + e]) for i in range(4)]
                continue
            pre, post = hidden
            grads[2 * E + e] = torch.mm(g.t(), post).unsqueeze(0)          # (1, d, h)
            grads[3 * E + e] = g.sum(0, keepdim=True)                       # (1, d)
            grad_pre = _activation_grad(act, pre, torch.mm(g, w2e))         # (n_e, h)
            grads[e] = torch.mm(grad_pre.t(), xe).unsqueeze(0)              # (1, h, d)
            grads[E + e] = grad_pre.sum(0, keepdim=True)                    # (1, h)
            torch.mm(grad_pre, w1e, out=gx)                                 # (n_e, d)
        return (grad_x, None, None, *grads)


def _plain_call(activation):
    """``nn.GELU`` as a plain function call (an nn.Module call costs a few microseconds, 64 times per step)."""
    if type(activation) is nn.GELU:
        return partial(F.gelu, approximate=activation.approximate)
    return activation


def expert_mlps(x: torch.Tensor, counts: list, experts, activation) -> torch.Tensor:
    """Run ``experts`` (``_Expert`` modules holding one expert each) on an expert-contiguous ``(N, d)`` buffer."""
    params = [[e.htoh4.weight for e in experts], [e.htoh4.bias for e in experts],
              [e.h4toh.weight for e in experts], [e.h4toh.bias for e in experts]]
    with torch.autocast(x.device.type, enabled=False):   # in the weights' dtype, as fastmoe's kernels
        return ExpertMLPs.apply(x.to(params[0][0].dtype), counts, activation, *params[0], *params[1], *params[2],
                                *params[3])


def grouped_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor, activation) -> torch.Tensor:
    """Every expert's MLP on an expert-contiguous ``(N, d)`` buffer as one grouped GEMM per linear
    (``torch._grouped_mm``), in fastmoe's layout ``w1 (E, h, d), b1 (E, h), w2 (E, d, h), b2 (E, d)``; ``counts``
    ``(E,)`` must sum to ``N`` (``torch._grouped_mm`` leaves rows past the last group unwritten) and is never read
    on the host: each row's bias is found on the device (``searchsorted`` over the group ends)."""
    counts = counts.to(x.device)
    rows = torch.arange(x.shape[0], device=x.device)                        # (N,)
    expert = torch.searchsorted(counts.cumsum(0), rows, right=True).clamp_max(w1.shape[0] - 1)  # (N,) row's expert
    hid = activation(grouped_matmul(x, w1.transpose(1, 2), counts) + b1.index_select(0, expert))  # (N, h)
    return grouped_matmul(hid, w2.transpose(1, 2), counts) + b2.index_select(0, expert)           # (N, d)


def grouped_expert_mlps(x: torch.Tensor, counts: torch.Tensor, experts, activation) -> torch.Tensor:
    """The grouped backend of ``FMoETransformerMLP``: its ``_Expert`` modules run by :func:`grouped_mlp`.

    The weights are stacked from the experts' ``(1, out, in)`` tensors each call (``torch.cat``: one copy of the
    expert weights forward, the split of their gradients backward), so checkpoints keep fastmoe's per-expert
    layout."""
    w1, b1, w2, b2 = (torch.cat([getattr(getattr(e, lin), name) for e in experts])   # (E, h, d), (E, h), ...
                      for lin, name in (("htoh4", "weight"), ("htoh4", "bias"), ("h4toh", "weight"), ("h4toh", "bias")))
    with torch.autocast(x.device.type, enabled=False):   # in the weights' dtype, as fastmoe's kernels
        return grouped_mlp(x.to(w1.dtype), counts, w1, b1, w2, b2, activation)
