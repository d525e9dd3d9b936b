"""``ModernMoE``: the 2024-2026 MoE feed-forward, one switch per idea. (Taught in chapter 09.)

    y_t = shared(x_t) + sum_{(e, w) routed to t} w * E_e(x_t)          (score after the experts)
    y_t = shared(x_t) + sum_{(e, w) routed to t} E_e(w * x_t)          (score_before_experts=True)

* routing ``"token"`` (:class:`TopKRouter`: softmax/sigmoid, route_norm/scale, aux-free bias, balance and z
  losses) or ``"expert"`` (each expert takes its top-C tokens, ``expert_choice.py``);
* ``capacity_factor``: ``None`` is dropless; a number caps each expert at ``ceil(cf * T * k / E)`` choices
  (expert choice: ``C = ceil(cf * T / E)``; both formulas in ``labutils.moe.capacity``), and over-capacity
  choices are dropped: first choices of every token are served before second choices (GShard's priority), in
  token order within a rank (the core's ``position_in_expert``);
* ``n_shared`` always-on experts (``shared_experts.py``); ``impl`` ``"auto"``, ``"loop"`` or ``"grouped"``
  (``torch._grouped_mm``), :mod:`labutils.moe.backends`.

After routing, the layer hands its choices to the lab's one dispatcher (:func:`labutils.moe.dispatch.dispatch`):
token choice as ``(T, k)`` ids with ``-1`` for a dropped choice, expert choice as ``(T, E)`` (column e holds e
where expert e took the token, else -1). With the grouped backend, token routing runs on the device path: no
host read from the router to the gradients (``device_path.py``).

While training, each forward appends to ``self.history``: ``counts`` ``(E,)``, ``dropped`` (share of token-choice
slots not served; for expert choice the share of tokens that got no expert), ``logit_rms``, ``logit_max`` and
``lse2`` (the z-loss value, mean squared logsumexp of the router logits), all tensors left where the layer runs
(reading them is a host synchronisation on a GPU: :meth:`ModernMoE.read_history` does it once, when asked).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ..capacity import expert_capacity, position_in_expert, token_choice_capacity
from ..device_path import bincount, device_path
from ..dispatch import dispatch, local
from .expert_choice import expert_choice_route
from .experts import RoutedExperts
from .routers import TopKRouter
from .shared import SharedExperts

ROUTINGS = ("token", "expert")


class ModernMoE(nn.Module):
    """``(..., d) -> (..., d)``. ``num_experts`` routed experts of width ``d_hidden``, ``top_k`` per token.

    Refused at construction, naming the argument and the value: an unknown ``routing``; ``capacity_factor``
    neither None nor a finite number > 0 (inf failed at the first forward with an OverflowError); expert
    routing without a ``capacity_factor``; and what :class:`TopKRouter` refuses (``top_k``, ``route_scale``,
    ``balance_coef``, ``z_coef``, ``bias_rate``, ...)."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 2, *, routing: str = "token",
                 n_shared: int = 0, shared_hidden: int | None = None, capacity_factor: float | None = None,
                 score_before_experts: bool = False, impl: str = "auto", **router_kwargs):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if capacity_factor is not None and not (isinstance(capacity_factor, numbers.Real)
                                                and not isinstance(capacity_factor, bool)
                                                and math.isfinite(capacity_factor) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None (dropless) or a finite number > 0, got "
                             f"{capacity_factor!r}")
        if routing == "expert" and capacity_factor is None:
            raise ValueError("expert-choice routing needs a capacity_factor (C = ceil(cf * T / E) tokens per expert)")
        self.d_model, self.num_experts, self.top_k, self.routing = d_model, num_experts, top_k, routing
        self.capacity_factor, self.score_before_experts = capacity_factor, score_before_experts
        self.router = TopKRouter(d_model, num_experts, top_k, **router_kwargs)
        self.experts = RoutedExperts(num_experts, d_model, d_hidden, impl)
        self.shared = SharedExperts(n_shared, d_model, shared_hidden or d_hidden) if n_shared else None
        self.history: list[dict] = []

    def route(self, x: torch.Tensor, seq_len: int | None):
        """``x`` ``(T, d)`` -> ``(idx, weights, dropped)``: expert ids ``(T, k)`` with ``-1`` for a choice over
        capacity (expert choice: ``(T, E)``, column e holding e where expert e took the token), their weights of
        the same shape, and the dropped share (a 0-d tensor)."""
        T, E = x.shape[0], self.num_experts
        if self.routing == "expert":
            scores = self.router.expert_choice_scores(x)                   # (T, E)
            capacity = expert_capacity(T, E, float(self.capacity_factor or 0))
            tok, gates = expert_choice_route(scores, capacity)             # (E, C) x2
            cols = torch.arange(E, device=x.device).expand(tok.shape[1], E)  # (C, E)
            idx = torch.full((T, E), -1, dtype=torch.long, device=x.device).scatter(0, tok.t(), cols)
            w = gates.new_zeros(T, E).scatter(0, tok.t(), gates.t())       # (T, E)
            return idx, w, 1 - (idx >= 0).any(1).float().mean()
        idx, w, _ = self.router(x, seq_len)                                # (T, k) x2
        if self.capacity_factor is None:
            return idx, w, x.new_zeros((), dtype=torch.float32)
        capacity = token_choice_capacity(T, E, self.capacity_factor, self.top_k)
        keep = position_in_expert(idx, E) < capacity                       # (T, k) first choices served first
        return idx.masked_fill(~keep, -1), w, 1 - keep.float().mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"ModernMoE(d_model={self.d_model}) got input of shape {tuple(x.shape)}")
        seq_len = x.shape[-2] if x.dim() >= 3 else None
        x2 = x.reshape(-1, self.d_model)                                   # (T, d)
        on_device = self.routing == "token" and self.experts.backend(x2.device) == "grouped"
        with device_path(on_device):
            idx, w, dropped = self.route(x2, seq_len)                      # (T, k) x2, ()
            y = dispatch([x2], idx, w.to(x.dtype), lambda xs, counts: [local(xs[0], counts, self.experts)],
                         num_expert=self.num_experts, score_before_experts=self.score_before_experts)[0]  # (T, d)
            if self.shared is not None:
                y = y + self.shared(x2)
            if self.training:
                counts = bincount(torch.where(idx >= 0, idx, self.num_experts), self.num_experts + 1)  # (E+1,)
                self.history.append(dict(counts=counts[:-1].detach(), dropped=dropped.detach(),
                                         **self.router.logit_stats()))
        return y.reshape(x.shape)

    def read_history(self) -> list[dict]:
        """``self.history`` read on the host, once: ``counts`` as CPU int64 ``(E,)`` tensors, the rest floats."""
        if not self.history:
            return []
        keys = list(self.history[0])
        flat = torch.stack([torch.cat([h[k].reshape(-1).double() for k in keys]) for h in self.history]).cpu()
        sizes = [self.history[0][k].numel() for k in keys]
        out = []
        for row in flat:
            parts = dict(zip(keys, row.split(sizes)))
            out.append({k: (v.long() if k == "counts" else float(v)) for k, v in parts.items()})
        return out

    def active_params(self) -> int:
        """Parameters one token passes through (expert choice: on average), router included."""
        per_expert = 2 * self.d_model * self.experts.d_hidden
        k = self.top_k if self.routing == "token" else float(self.capacity_factor or 0)
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared is not None else 0
        return int(k * per_expert) + shared + sum(p.numel() for p in self.router.parameters())
