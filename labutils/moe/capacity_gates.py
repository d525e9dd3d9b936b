"""Capacity-limited gates: GShard (top-2) and Switch (top-1), as fastmoe computes them. (Taught in chapter 01.)

The capacity arithmetic (each gate's formula, fastmoe's ``limit_by_capacity``, the deterministic drop order) is
in ``capacity.py``; :class:`CapacityGate` is what the capacity gates share (a fixed top-k, the (train, eval)
factors, the capacity per expert).
"""
from __future__ import annotations

import torch

from .._deprecate import forward_moved
from .capacity import (
    CapacityFactors,
    drop_over_capacity,
    fastmoe_gshard_capacity,
    fastmoe_switch_capacity,
    limit_by_capacity,
    warn_small_capacity,
)
from .functions import check_top_k
from .gates import NaiveGate, check_finite_logits

# limit_by_capacity and position_in_expert, here in 0.2.0, are capacity.py's: their old path warns until 1.0.0
__all__ = ["CapacityGate", "GShardGate", "SwitchGate"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)


class CapacityGate(NaiveGate):
    """A fastmoe gate with a fixed ``top_k`` (:attr:`fixed_top_k`) and a capacity per expert from its
    ``(train, eval)`` capacity factors: :meth:`capacity_formula` is the gate's formula (``capacity.py``)."""

    capacity = CapacityFactors()  # (train, eval) factors, checked on every assignment
    fixed_top_k = 0

    def __init__(self, d_model: int, num_expert: int, world_size: int, top_k: int, capacity, gate_bias: bool,
                 topk=None):
        top_k = top_k if topk is None else topk  # fastmoe spells it `topk`
        check_top_k(top_k, num_expert * world_size)
        k = self.fixed_top_k
        if top_k != k:
            raise ValueError(f"{type(self).__name__} is a top-{k} gate; got top_k={top_k} (pass top_k={k} to FMoE)")
        super().__init__(d_model, num_expert, world_size, top_k=k, gate_bias=gate_bias)
        self.capacity = capacity

    def capacity_formula(self, num_tokens: int, factor: float) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define capacity_formula")

    def capacity_per_expert(self, num_tokens: int) -> int:
        """Slots per expert for ``num_tokens`` tokens with the factor of the current mode (warns below 1)."""
        factor = self.capacity[0 if self.training else 1]
        cap = self.capacity_formula(num_tokens, factor)
        warn_small_capacity(type(self).__name__, cap, factor, num_tokens)
        return cap


class GShardGate(CapacityGate):
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

    fixed_top_k = 2

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 capacity=(1.2, 2.4), random_routing: bool = True, gate_bias: bool = True, topk=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, gate_bias, topk)
        self.random_routing = random_routing

    def capacity_formula(self, num_tokens: int, factor: float) -> int:
        return fastmoe_gshard_capacity(num_tokens, factor, self.top_k, self.tot_expert)

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


class SwitchGate(CapacityGate):
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

    fixed_top_k = 1

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 1,
                 switch_eps: float = 0.1, capacity=(1.2, 2.4), gate_bias: bool = True, topk=None, group=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, gate_bias, topk)
        self.switch_eps = switch_eps
        self.group = group

    def capacity_formula(self, num_tokens: int, factor: float) -> int:
        return fastmoe_switch_capacity(num_tokens, factor, self.num_expert)

    def forward(self, x):
        _, _, logits = self.top_k_logits(x)                                  # (T, E)
        check_finite_logits(self, logits)
        if self.training:
            logits = logits + (torch.rand_like(logits) * 2 * self.switch_eps + 1.0 - self.switch_eps)
        probs = torch.softmax(logits.float(), dim=-1)                        # (T, E) fp32
        score, idx = probs.topk(1, dim=-1)                                   # (T, 1)
        cap = self.capacity_per_expert(x.shape[0])
        _, _, idx = limit_by_capacity(idx, self.num_expert, world_size=self.world_size, capacity=cap,
                                     group=self.group)
        kept = idx[idx >= 0]                                                 # (N,)
        if kept.numel():
            frac = torch.bincount(kept, minlength=self.tot_expert).float() / kept.numel()
            self.set_loss((frac * probs.sum(0) / kept.numel()).sum() * self.tot_expert)
        else:
            self.set_loss(probs.sum() * 0.0)
        return idx, score.to(x.dtype)
