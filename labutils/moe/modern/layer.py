"""``ModernMoE``: the 2024-2026 MoE feed-forward, one switch per idea. (Taught in chapter 09.)

    y_t = shared(x_t) + sum_{(e, w) routed to t} w * E_e(x_t)          (score after the experts)
    y_t = shared(x_t) + sum_{(e, w) routed to t} E_e(w * x_t)          (score_before_experts=True)

* routing ``"token"`` (:class:`TopKRouter`: softmax/sigmoid, route_norm/scale, aux-free bias, balance and z
  losses) or ``"expert"`` (each expert takes its top-C tokens, ``expert_choice.py``);
* ``capacity_factor``: ``None`` is dropless; a number caps each expert at ``ceil(cf * T * k / E)`` choices
  (expert choice: ``C = ceil(cf * T / E)``), and over-capacity choices are dropped: first choices of every token
  are served before second choices (GShard's priority), in token order within a rank;
* ``n_shared`` always-on experts (``shared_experts.py``); ``impl`` ``"loop"`` or ``"grouped"`` (``torch._grouped_mm``).

While training, each forward appends to ``self.history``: ``counts`` ``(E,)``, ``dropped`` (share of token-choice
slots not served; for expert choice the share of tokens that got no expert), ``logit_rms``, ``logit_max`` and
``lse2`` (the z-loss value, mean squared logsumexp of the router logits).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .aux_free import check_expert_bias
from .expert_choice import expert_capacity, expert_choice_route
from .experts import RoutedExperts
from .losses import z_loss
from .routers import TopKRouter
from .shared import SharedExperts

ROUTINGS = ("token", "expert")


def keep_within_capacity(idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``idx`` ``(T, k)`` -> ``(T, k)`` bool: which choices fit ``capacity`` per expert, rank-0 choices first."""
    T, k = idx.shape
    by_rank = idx.t().reshape(-1)                                          # (k T): all first choices, then second
    onehot = torch.nn.functional.one_hot(by_rank, num_experts)             # (k T, E)
    position = (onehot.cumsum(0) * onehot).sum(1) - 1                      # (k T) slot within its expert
    return (position < capacity).reshape(k, T).t()                         # (T, k)


class ModernMoE(nn.Module):
    """``(..., d) -> (..., d)``. ``num_experts`` routed experts of width ``d_hidden``, ``top_k`` per token."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 2, *, routing: str = "token",
                 n_shared: int = 0, shared_hidden: int | None = None, capacity_factor: float | None = None,
                 score_before_experts: bool = False, impl: str = "loop", **router_kwargs):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {capacity_factor}")
        if routing == "expert" and capacity_factor is None:
            raise ValueError("expert-choice routing needs a capacity_factor (C = ceil(cf * T / E) tokens per expert)")
        self.d_model, self.num_experts, self.top_k, self.routing = d_model, num_experts, top_k, routing
        self.capacity_factor, self.score_before_experts = capacity_factor, score_before_experts
        self.router = TopKRouter(d_model, num_experts, top_k, **router_kwargs)
        self.experts = RoutedExperts(num_experts, d_model, d_hidden, impl)
        self.shared = SharedExperts(n_shared, d_model, shared_hidden or d_hidden) if n_shared else None
        self.history: list[dict] = []

    def route(self, x: torch.Tensor, seq_len: int | None):
        """``x`` ``(T, d)`` -> served choices as flat ``experts (n,), tokens (n,), weights (n,)``; dropped share."""
        T, E = x.shape[0], self.num_experts
        if self.routing == "expert":
            logits = self.router.gate(x)                                   # (T, E)
            self.router.last_logits = logits.detach()
            if self.router.z_coef:
                self.router.set_loss(self.router.z_coef * z_loss(logits))
            capacity = expert_capacity(T, E, float(self.capacity_factor or 0))
            tok, gates = expert_choice_route(torch.softmax(logits.float(), -1), capacity)    # (E, C) x2
            served = torch.zeros(T, dtype=torch.bool, device=x.device).index_fill_(0, tok.reshape(-1), True)
            experts = torch.arange(E, device=x.device).repeat_interleave(tok.shape[1])
            return experts, tok.reshape(-1), gates.reshape(-1), 1 - served.float().mean().item()
        if self.router.expert_bias is not None:
            check_expert_bias(self.router.expert_bias, "ModernMoE.router.expert_bias")
        idx, w, _ = self.router(x, seq_len)                                # (T, k) x2
        tokens = torch.arange(T, device=x.device).repeat_interleave(self.top_k)
        if self.capacity_factor is None:
            return idx.reshape(-1), tokens, w.reshape(-1), 0.0
        keep = keep_within_capacity(idx, E, math.ceil(self.capacity_factor * T * self.top_k / E)).reshape(-1)
        return idx.reshape(-1)[keep], tokens[keep], w.reshape(-1)[keep], 1 - keep.float().mean().item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"ModernMoE(d_model={self.d_model}) got input of shape {tuple(x.shape)}")
        seq_len = x.shape[-2] if x.dim() >= 3 else None
        x2 = x.reshape(-1, self.d_model)                                   # (T, d)
        experts, tokens, w, dropped = self.route(x2, seq_len)              # (n,) x3
        order = torch.argsort(experts, stable=True)                        # expert-contiguous
        tokens, w = tokens[order], w[order].to(x.dtype)
        counts = torch.bincount(experts, minlength=self.num_experts)       # (E,)
        xs = x2[tokens]                                                    # (n, d)
        if self.score_before_experts:
            xs = xs * w[:, None]
        ys = self.experts(xs, counts)                                      # (n, d)
        if not self.score_before_experts:
            ys = ys * w[:, None]
        y = torch.zeros_like(x2).index_add_(0, tokens, ys)                 # (T, d)
        if self.shared is not None:
            y = y + self.shared(x2)
        if self.training:
            logits = self.router.last_logits
            stats = dict(counts=counts.detach().cpu(), dropped=dropped, logit_rms=0.0, logit_max=0.0, lse2=0.0)
            if logits is not None:
                stats.update(logit_rms=float(logits.pow(2).mean().sqrt()), logit_max=float(logits.abs().max()),
                             lse2=float(z_loss(logits)))
            self.history.append(stats)
        return y.reshape(x.shape)

    def active_params(self) -> int:
        """Parameters one token passes through (expert choice: on average), router included."""
        per_expert = 2 * self.d_model * self.experts.d_hidden
        k = self.top_k if self.routing == "token" else float(self.capacity_factor or 0)
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared is not None else 0
        return int(k * per_expert) + shared + self.router.gate.weight.numel()
