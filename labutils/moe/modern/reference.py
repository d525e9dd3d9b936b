"""Brute-force reference for :class:`ModernMoE`: one token, one expert at a time, Python loops, no sorting
tricks. Every chapter 09 parity check compares the layer with it. (Taught in chapter 09.) The capacities are
the core's formulas (``labutils.moe.capacity``, tested on their own); the routing and the drops are re-derived.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..capacity import expert_capacity, token_choice_capacity


def _expert(layer, e: int, v: torch.Tensor) -> torch.Tensor:
    return F.gelu(v @ layer.experts.w1[e].t()) @ layer.experts.w2[e].t()           # (d,) -> (d,): (E, out, in)


def reference_routes(layer, x2: torch.Tensor) -> list:
    """``[(token, expert, weight)]`` served by ``layer`` for ``x2`` ``(T, d)``, in Python loops."""
    router, T, E = layer.router, x2.shape[0], layer.num_experts
    logits = x2 @ router.gate.weight.t()                                           # (T, E)
    if layer.routing == "expert":
        probs = torch.softmax(logits, -1)
        C = expert_capacity(T, E, layer.capacity_factor)
        return [(t, e, probs[t, e]) for e in range(E)
                for t in sorted(range(T), key=lambda t: -float(probs[t, e].detach()))[:C]]
    chosen = []
    for t in range(T):
        s = torch.sigmoid(logits[t]) if router.score_func == "sigmoid" else torch.softmax(logits[t], -1)
        bias = router.expert_bias if router.expert_bias is not None else torch.zeros(E)
        top = sorted(range(E), key=lambda e: -float((s[e] + bias[e]).detach()))[:layer.top_k]
        w = torch.stack([s[e] for e in top])
        if router.route_norm:
            w = w / w.sum()
        chosen.append([(t, e, router.route_scale * w[j]) for j, e in enumerate(top)])
    if layer.capacity_factor is None:
        return [c for row in chosen for c in row]
    cap, used, kept = token_choice_capacity(T, E, layer.capacity_factor, layer.top_k), [0] * E, []
    for j in range(layer.top_k):              # every token's first choice, then every second choice, ...
        for t in range(T):
            _, e, w = chosen[t][j]
            if used[e] < cap:
                used[e] += 1
                kept.append((t, e, w))
    return kept


def reference_modern_moe(layer, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` must return, computed token by token."""
    x2 = x.reshape(-1, layer.d_model)
    rows = [torch.zeros(layer.d_model, dtype=x.dtype) for _ in range(x2.shape[0])]
    for t, e, w in reference_routes(layer, x2):
        if layer.score_before_experts:
            rows[t] = rows[t] + _expert(layer, e, w * x2[t])
        else:
            rows[t] = rows[t] + w * _expert(layer, e, x2[t])
    if layer.shared is not None:
        for t in range(x2.shape[0]):
            for w1, w2 in layer.shared.as_experts():
                rows[t] = rows[t] + F.gelu(x2[t] @ w1) @ w2
    return torch.stack(rows).reshape(x.shape)
