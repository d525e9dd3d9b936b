"""Capacity-limited gates: GShard (top-2) and Switch (top-1), as fastmoe computes them. (Taught in chapter 01.)

The capacity arithmetic (fastmoe's ``limit_by_capacity``, the deterministic drop order) is in ``capacity.py``.
"""
from __future__ import annotations

import math

import torch

from .capacity import (
    CapacityFactors,
    drop_over_capacity,
    exchange_counts,
    limit_by_capacity,
    position_in_expert,
    warn_small_capacity,
)
from .functions import check_top_k
from .gates import NaiveGate, check_finite_logits

# limit_by_capacity and position_in_expert keep their 0.2.0 import path here
__all__ = ["GShardGate", "SwitchGate", "limit_by_capacity", "drop_over_capacity", "position_in_expert",
           "exchange_counts"]


class GShardGate(NaiveGate):
    """GShard's top-2 gate (Lepikhin et al. 2020) as fastmoe computes it (``fmoe/gates/gshard_gate.py``).

    * balance loss ``mean_e(c_e m_e) * num_expert**2`` (``c_e`` share of tokens whose FIRST choice is ``e``,
      ``m_e`` mean router probability); with one worker this is ``E * sum_e c_e m_e``; with ``W`` workers
      fastmoe's formula uses the LOCAL ``num_expert``, so the loss is ``1/W**2`` of that;
    * capacity per expert ``floor(ceil(factor * T) * 2 / tot_expert)`` (fastmoe's rounding; can be 0: warned),
      factor ``capacity[0]`` in training, ``capacity[1]`` in eval (default 1.2 / 2.4), applied to this
      worker's tokens only;
    * THEN random routing (default on, in training AND eval, as in fastmoe): the second choice is dropped
      when ``2 * g2 < u``, ``u ~ U(0, 1)``. Pass ``random_routing=False`` for a deterministic gate.
    """

    capacity = CapacityFactors()  # (train, eval) factors, checked on every assignment

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 capacity=(1.2, 2.4), random_routing: bool = True, gate_bias: bool = True, topk=None):
        top_k = top_k if topk is None else topk  # fastmoe spells it `topk`
        check_top_k(top_k, num_expert * world_size)
        if top_k != 2:
            raise ValueError(f"{type(self).__name__} is a top-2 gate; got top_k={top_k} (pass top_k=2 to FMoE)")
        super().__init__(d_model, num_expert, world_size, top_k=2, gate_bias=gate_bias)
        self.capacity = capacity
        self.random_routing = random_routing

    def capacity_per_expert(self, num_tokens: int) -> int:
        factor = self.capacity[0 if self.training else 1]
        cap = math.ceil(factor * num_tokens) * self.top_k // self.tot_expert
        warn_small_capacity(type(self).__name__, cap, factor, num_tokens)
        return cap

    def apply_capacity(self, idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This worker's tokens only, each global expert ``capacity_per_expert`` (fastmoe: prune_gate_by_capacity)."""
        return drop_over_capacity(idx, self.tot_expert, self.capacity_per_expert(num_tokens))

    def forward(self, x):
        idx, score, logits = self.top_k_logits(x)                            # (T, 2), (T, 2), (T, E)
        check_finite_logits(self, logits)
        T = x.shape[0]
        if T:
            c_e = torch.bincount(idx[:, 0], minlength=self.tot_expert).to(logits.dtype) / T  # (E,)
            m_e = torch.softmax(logits, dim=1).mean(0)                                        # (E,)
            self.set_loss((c_e * m_e).mean() * self.num_expert ** 2)
        else:  # fastmoe: 0/0 = NaN
            self.set_loss(logits.sum() * 0.0)
        idx = self.apply_capacity(idx, T)
        if self.random_routing:
            drop2 = 2 * score[:, 1].detach() < torch.rand(T, device=x.device)
            idx = torch.stack([idx[:, 0], idx[:, 1].masked_fill(drop2, -1)], dim=1)
        return idx, score


class SwitchGate(NaiveGate):
    """Switch Transformer's top-1 gate (Fedus et al. 2021) as fastmoe computes it (``fmoe/gates/switch_gate.py``).

    * jitter (training only): ``U(1-eps, 1+eps)`` noise ADDED to the logits (the constant 1 cancels in the
      softmax; the paper multiplies the router input instead);
    * score = the fp32 softmax probability of the chosen expert, in the input's dtype;
    * capacity per expert ``ceil(factor * T / num_expert)`` over ALL workers' tokens (:func:`limit_by_capacity`);
    * balance loss ``E * sum_e f_e * P_e`` computed AFTER dropping: ``f_e`` share of the KEPT tokens routed to
      ``e``, ``P_e`` summed router probability over all tokens divided by the number of kept tokens
      (0 when nothing is kept; fastmoe gives NaN there).

    ``group``: the process group of the ``world_size`` workers (default: the default group).
    """

    capacity = CapacityFactors()  # (train, eval) factors, checked on every assignment

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 1,
                 switch_eps: float = 0.1, capacity=(1.2, 2.4), gate_bias: bool = True, topk=None, group=None):
        top_k = top_k if topk is None else topk
        check_top_k(top_k, num_expert * world_size)
        if top_k != 1:
            raise ValueError(f"SwitchGate is a top-1 gate; got top_k={top_k} (pass top_k=1 to FMoE)")
        super().__init__(d_model, num_expert, world_size, top_k=1, gate_bias=gate_bias)
        self.switch_eps = switch_eps
        self.capacity = capacity
        self.group = group

    def capacity_per_expert(self, num_tokens: int) -> int:
        factor = self.capacity[0 if self.training else 1]
        cap = math.ceil(factor * num_tokens / self.num_expert)
        warn_small_capacity("SwitchGate", cap, factor, num_tokens)
        return cap

    def forward(self, x):
        _, _, logits = self.top_k_logits(x)                                  # (T, E)
        check_finite_logits(self, logits)
        if self.training:
            logits = logits + (torch.rand_like(logits) * 2 * self.switch_eps + 1.0 - self.switch_eps)
        probs = torch.softmax(logits.float(), dim=-1)                        # (T, E) fp32
        score, idx = probs.topk(1, dim=-1)                                   # (T, 1)
        cap = self.capacity_per_expert(x.shape[0])
        _, _, idx = limit_by_capacity(idx, self.num_expert, self.world_size, cap, group=self.group)
        kept = idx[idx >= 0]                                                 # (N,)
        if kept.numel():
            frac = torch.bincount(kept, minlength=self.tot_expert).float() / kept.numel()
            self.set_loss((frac * probs.sum(0) / kept.numel()).sum() * self.tot_expert)
        else:
            self.set_loss(probs.sum() * 0.0)
        return idx, score.to(x.dtype)
