"""The problem every dispatch design solves, its shared routing, and one training step. (Taught in chapter 08.)

* :class:`Problem`: input, routing logits and expert weights in fastmoe's layout (``w1 (E, h, d), b1 (E, h),
  w2 (E, d, h), b2 (E, d)``), all leaves with ``requires_grad``, plus the two references' inputs;
  :func:`make_problem` draws a seeded one.
* :func:`route`: the same ``logits (T, E)`` -> ``(idx, score)`` for every design, DeepSpeed's convention (softmax
  over all experts, top-k, scores renormalised over the k when k > 1), so DeepSpeed's layer, fed the same logits,
  computes the same output wherever it drops nothing.
* :class:`DispatchOut`: what a design returns; :func:`fwd_bwd`: one forward+backward of a design.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from labutils.moe.functions import check_top_k, count_by_gate

__all__ = ["Problem", "DispatchOut", "make_problem", "route", "expert_mlp", "fwd_bwd"]


@dataclass
class Problem:
    """Inputs, routing logits and expert weights (all leaves with ``requires_grad``), plus the references' inputs."""
    x: torch.Tensor            # (T, d)
    logits: torch.Tensor       # (T, E)
    w1: torch.Tensor           # (E, h, d)
    b1: torch.Tensor           # (E, h)
    w2: torch.Tensor           # (E, d, h)
    b2: torch.Tensor           # (E, d)
    top_k: int
    grad_y: torch.Tensor       # (T, d) the output gradient every backward uses
    dense_w: list = field(default_factory=list)     # dense MLP d -> k*h -> d: W1 (k*h, d), b1, W2 (d, k*h), b2
    sliced_x: list = field(default_factory=list)    # E leaves (n_e, d): tokens already grouped by expert
    sliced_grad: list = field(default_factory=list)  # E tensors (n_e, d)
    sliced_w: list = field(default_factory=list)    # E tuples (w1_e, b1_e, w2_e, b2_e), own leaves

    T = property(lambda self: self.x.shape[0])
    d = property(lambda self: self.x.shape[1])
    h = property(lambda self: self.w1.shape[1])
    E = property(lambda self: self.w1.shape[0])

    def leaves(self) -> list:
        """Every tensor a backward may write a ``.grad`` into."""
        out = [self.x, self.logits, self.w1, self.b1, self.w2, self.b2, *self.dense_w, *self.sliced_x]
        return out + [t for ws in self.sliced_w for t in ws]

    def zero_grad(self) -> None:
        for t in self.leaves():
            t.grad = None

    def flops(self) -> float:
        """Useful FLOPs of one forward+backward: 2 linears x 3 matmuls (out, grad in, grad w) x 2*T*k*d*h."""
        return 12.0 * self.T * self.top_k * self.d * self.h


class DispatchOut(NamedTuple):
    y: object        # (T, d), or a list of per-expert outputs for the ``separate`` reference
    kept: int        # (token, choice) pairs that reached an expert (T*k when nothing is dropped)
    rows: int        # rows the experts computed, padding included
    dropped: object = None  # (T,) bool: tokens with at least one choice dropped (None: the design drops nothing)


def route(logits: torch.Tensor, top_k: int):
    """``(T, E)`` logits -> ``idx (T, k)`` int64 and ``score (T, k)``, DeepSpeed's convention (see module doc)."""
    probs = logits.float().softmax(dim=-1)                                 # (T, E)
    score, idx = probs.topk(top_k, dim=-1)                                 # (T, k)
    if top_k > 1:
        score = score / score.sum(dim=-1, keepdim=True)
    return idx, score


def make_problem(tokens: int, d_model: int, d_hidden: int, num_expert: int, top_k: int, seed: int = 0,
                 device: str | torch.device = "cpu", dtype=torch.float32, limits: bool = True) -> Problem:
    """A seeded random problem; ``limits`` also builds the dense and pre-sliced inputs of the two references."""
    check_top_k(top_k, num_expert)
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    T, d, h, E = tokens, d_model, d_hidden, num_expert
    p = Problem(x=leaf(T, d), logits=leaf(T, E).detach().float().requires_grad_(),
                w1=leaf(E, h, d, scale=d ** -0.5), b1=leaf(E, h, scale=0.1),
                w2=leaf(E, d, h, scale=h ** -0.5), b2=leaf(E, d, scale=0.1), top_k=top_k,
                grad_y=torch.randn(T, d, generator=g).to(device=device, dtype=dtype))
    if limits:
        p.dense_w = [leaf(top_k * h, d, scale=d ** -0.5), leaf(top_k * h, scale=0.1),
                     leaf(d, top_k * h, scale=h ** -0.5), leaf(d, scale=0.1)]
        _, counts = count_by_gate(route(p.logits, top_k)[0], E)
        for n in counts.tolist():
            p.sliced_x.append(leaf(n, d))
            p.sliced_grad.append(torch.randn(n, d, generator=g).to(device=device, dtype=dtype))
            p.sliced_w.append((leaf(h, d, scale=d ** -0.5), leaf(h, scale=0.1), leaf(d, h, scale=h ** -0.5),
                               leaf(d, scale=0.1)))
    return p


def expert_mlp(x, w1, b1, w2, b2):
    """One expert: ``(n, d) -> (n, h) -> GELU -> (n, d)``."""
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def fwd_bwd(fn, p: Problem) -> DispatchOut:
    """One training step of a design: forward, then backward of ``p.grad_y`` (grads land in ``.grad``)."""
    p.zero_grad()
    if isinstance(fn, nn.Module):
        fn.zero_grad(set_to_none=True)
    out = fn(p)
    if isinstance(out.y, list):
        grads = [g for g in p.sliced_grad if g.shape[0]]
        torch.autograd.backward(out.y, grads)
    else:
        out.y.backward(p.grad_y)
    return out
