"""Capacity-limited gates: GShard (top-2) and Switch (top-1). (Taught in chapter 01.)

Both cap the tokens an expert accepts. Over-capacity choices become ``-1`` (dropped: the token gets nothing
from that expert; in a transformer the residual connection carries it). Unlike fastmoe, which drops in the
order its CUDA atomics happen to run, :func:`limit_by_capacity` drops deterministically: all first choices
in token order, then all second choices in token order (GShard's Algorithm 1), so a result is reproducible.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .gates import NaiveGate


def position_in_expert(gate_idx: torch.Tensor, tot_expert: int) -> torch.Tensor:
    """Each choice's arrival rank at its expert, in priority order (choice column first, then token).

    ``gate_idx`` is ``(T, k)``; the result is ``(T, k)`` int64, ``-1`` where ``gate_idx`` is ``-1``.
    """
    flat = gate_idx.t().reshape(-1)                                     # (k*T,) all 1st choices, then 2nd...
    key = torch.where(flat >= 0, flat, torch.full_like(flat, tot_expert))
    order = torch.argsort(key, stable=True)                             # expert-major, priority within
    counts = torch.bincount(key, minlength=tot_expert + 1)              # (E+1,)
    starts = torch.cumsum(counts, 0) - counts                           # (E+1,) first slot of each expert
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
    rank = torch.where(flat >= 0, rank, torch.full_like(rank, -1))
    return rank.reshape(gate_idx.shape[1], -1).t()                      # (T, k)


def limit_by_capacity(gate_idx: torch.Tensor, tot_expert: int, capacity) -> torch.Tensor:
    """Return a copy of ``gate_idx`` with every choice beyond an expert's ``capacity`` set to ``-1``.

    ``capacity`` is an int or a ``(tot_expert,)`` tensor. Deterministic: first choices have priority over
    second choices, earlier tokens over later ones.
    """
    with torch.no_grad():
        rank = position_in_expert(gate_idx, tot_expert)
        cap = torch.as_tensor(capacity, device=gate_idx.device)
        cap = cap[gate_idx.clamp_min(0)] if cap.dim() else cap
        return torch.where((gate_idx >= 0) & (rank < cap), gate_idx, torch.full_like(gate_idx, -1))


def _tokens_per_expert(idx: torch.Tensor, tot_expert: int) -> torch.Tensor:
    """Fraction of the ``T`` tokens whose choice ``idx`` (shape ``(T,)``) is each expert (not differentiable)."""
    count = torch.bincount(idx[idx >= 0], minlength=tot_expert).float()
    return count / max(idx.shape[0], 1)


class GShardGate(NaiveGate):
    """GShard's top-2 gate (Lepikhin et al. 2020).

    * capacity per expert = ``ceil(factor * top_k * T / tot_expert)``, factor ``capacity[0]`` in training and
      ``capacity[1]`` in eval (fastmoe's defaults 1.2 / 2.4);
    * random routing: the second choice is kept with probability ``2 * g2`` (``g2`` its normalised weight);
    * balance loss ``E * sum_e c_e * m_e`` (``c_e`` share of tokens whose FIRST choice is ``e``, before any drop;
      ``m_e`` mean router probability), which equals GShard's ``mean_e(c_e m_e) * E^2``.
    """

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 capacity=(1.2, 2.4), random_routing: bool = True, gate_bias: bool = True, topk=None):
        top_k = top_k if topk is None else topk  # fastmoe spells it `topk`
        if top_k != 2:
            raise ValueError(f"GShardGate is a top-2 gate; got top_k={top_k} (pass top_k=2 to FMoE)")
        super().__init__(d_model, num_expert, world_size, top_k=2, gate_bias=gate_bias)
        self.capacity = capacity
        self.random_routing = random_routing

    def capacity_per_expert(self, num_tokens: int) -> int:
        factor = self.capacity[0 if self.training else 1]
        return math.ceil(factor * self.top_k * num_tokens / self.tot_expert)

    def forward(self, x):
        idx, score, logits = super().forward(x, return_all_scores=True)     # (T, 2), (T, 2), (T, E)
        c_e = _tokens_per_expert(idx[:, 0], self.tot_expert)                 # (E,)
        m_e = F.softmax(logits.float(), dim=-1).mean(0) if len(x) else logits.new_zeros(self.tot_expert)
        self.set_loss((c_e * m_e).sum() * self.tot_expert)
        if self.random_routing:
            keep2 = torch.rand(idx.shape[0], device=x.device) < 2 * score[:, 1].detach()
            idx = torch.stack([idx[:, 0], torch.where(keep2, idx[:, 1], -1)], dim=1)
        idx = limit_by_capacity(idx, self.tot_expert, self.capacity_per_expert(x.shape[0]))
        return idx, score


class SwitchGate(NaiveGate):
    """Switch Transformer's top-1 gate (Fedus et al. 2021).

    * jitter: in training the ROUTER's input is multiplied by ``U(1-eps, 1+eps)`` (the paper; fastmoe adds
      uniform noise to the logits instead);
    * score = the softmax probability of the chosen expert (computed in fp32);
    * capacity per expert = ``ceil(factor * T / tot_expert)``, factor ``capacity[0]`` train / ``capacity[1]`` eval;
    * balance loss ``E * sum_e f_e * P_e``: ``f_e`` share of tokens whose argmax is ``e`` (before drops),
      ``P_e`` mean router probability over all tokens.
    """

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 1,
                 switch_eps: float = 0.1, capacity=(1.2, 2.4), gate_bias: bool = True, topk=None):
        top_k = top_k if topk is None else topk
        if top_k != 1:
            raise ValueError(f"SwitchGate is a top-1 gate; got top_k={top_k} (pass top_k=1 to FMoE)")
        super().__init__(d_model, num_expert, world_size, top_k=1, gate_bias=gate_bias)
        self.switch_eps = switch_eps
        self.capacity = capacity

    def capacity_per_expert(self, num_tokens: int) -> int:
        factor = self.capacity[0 if self.training else 1]
        return math.ceil(factor * num_tokens / self.tot_expert)

    def forward(self, x):
        if self.training and self.switch_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.switch_eps, 1.0 + self.switch_eps)
        probs = F.softmax(self.gate(x).float(), dim=-1)                      # (T, E) fp32
        score, idx = probs.topk(1, dim=-1)                                   # (T, 1)
        f_e = _tokens_per_expert(idx[:, 0], self.tot_expert)
        p_e = probs.mean(0) if len(x) else probs.new_zeros(self.tot_expert)
        self.set_loss((f_e * p_e).sum() * self.tot_expert)
        idx = limit_by_capacity(idx, self.tot_expert, self.capacity_per_expert(x.shape[0]))
        return idx, score.to(x.dtype)
