"""Gates: which experts each token goes to, and with what weight. (Taught in chapter 01.)

Every gate follows fastmoe's contract: ``gate(d_model, num_expert, world_size, top_k)`` builds it and
``gate(x)`` with ``x`` of shape ``(T, d_model)`` returns

* ``gate_top_k_idx``: ``(T, top_k)`` int64, a GLOBAL expert id in ``0 .. world_size*num_expert-1``, or ``-1``
  when the token's k-th choice was dropped (over capacity, or not sampled);
* ``gate_score``: ``(T, top_k)`` float, the weight of each choice in the combined output.

A gate's auxiliary (load-balancing) loss is stored with ``set_loss`` and read with ``get_loss``;
:func:`collect_aux_loss` sums them over a whole model. The capacity-limited gates (GShard, Switch) live in
``capacity_gates.py``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BaseGate(nn.Module):
    """Holds ``num_expert`` (per worker), ``world_size``, ``tot_expert`` and the auxiliary loss."""

    def __init__(self, num_expert: int, world_size: int):
        super().__init__()
        self.num_expert = num_expert
        self.world_size = world_size
        self.tot_expert = num_expert * world_size
        self.loss = None

    def forward(self, x):  # pragma: no cover - abstract
        raise NotImplementedError("BaseGate is abstract: use NaiveGate, NoisyGate, GShardGate or SwitchGate")

    def set_loss(self, loss):
        self.loss = loss

    def get_loss(self, clear: bool = True):
        loss = self.loss
        if clear:
            self.loss = None
        return loss

    @property
    def has_loss(self) -> bool:
        return self.loss is not None


def _check_top_k(top_k: int, tot_expert: int) -> None:
    if not 1 <= top_k <= tot_expert:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                         f"(world_size * num_expert = {tot_expert})")


class NaiveGate(BaseGate):
    """A linear layer, top-k of its logits, softmax over the k chosen logits. No balancing loss (it is 0)."""

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2, gate_bias: bool = True):
        super().__init__(num_expert, world_size)
        _check_top_k(top_k, self.tot_expert)
        self.gate = nn.Linear(d_model, self.tot_expert, bias=gate_bias)
        self.top_k = top_k

    def forward(self, x, return_all_scores: bool = False):
        logits = self.gate(x)                                               # (T, E)
        top_val, top_idx = torch.topk(logits, k=self.top_k, dim=-1)         # (T, k), sorted best first
        score = F.softmax(top_val, dim=-1)                                  # (T, k)
        self.set_loss(logits.new_zeros(()))
        if return_all_scores:
            return top_idx, score, logits
        return top_idx, score


def cv_squared(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation ``var(x) / mean(x)^2`` (Shazeer et al. 2017); 0 for one element."""
    if x.numel() <= 1:
        return x.new_zeros(())
    x = x.float()
    return x.var() / (x.mean() ** 2 + eps)


class NoisyGate(BaseGate):
    """Noisy top-k gating (Shazeer et al. 2017, "Outrageously large neural networks").

    logits = x W_g + N(0,1) * softplus(x W_noise) (noise only in training); softmax over the top-k.
    Loss = ``w_importance * cv²(importance) + w_load * cv²(load)``: importance is the summed gate weight per
    expert; load is the differentiable expected number of tokens per expert (probability of staying in the
    top-k under fresh noise). Without noise (eval) the load is the plain count, as in the paper.
    """

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 noise_epsilon: float = 1e-2, w_importance: float = 1.0, w_load: float = 1.0):
        super().__init__(num_expert, world_size)
        _check_top_k(top_k, self.tot_expert)
        self.w_gate = nn.Parameter(torch.zeros(d_model, self.tot_expert))   # (d, E) as in fastmoe
        self.w_noise = nn.Parameter(torch.zeros(d_model, self.tot_expert))  # (d, E)
        self.top_k = top_k
        self.noise_epsilon = noise_epsilon
        self.w_importance, self.w_load = w_importance, w_load
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.w_gate, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.w_noise, a=math.sqrt(5))

    def forward(self, x):
        clean = x @ self.w_gate                                             # (T, E)
        if self.training:
            stddev = F.softplus(x @ self.w_noise) + self.noise_epsilon      # (T, E)
            logits = clean + torch.randn_like(clean) * stddev
        else:
            stddev, logits = None, clean
        m = min(self.top_k + 1, self.tot_expert)
        top_logits, top_idx = logits.topk(m, dim=-1)                        # (T, m)
        idx, score = top_idx[:, :self.top_k], F.softmax(top_logits[:, :self.top_k], dim=-1)
        gates = torch.zeros_like(logits).scatter(1, idx, score)             # (T, E), dense weights
        if self.training and self.top_k < self.tot_expert:
            load = self._prob_in_top_k(clean, logits, stddev, top_logits).sum(0)
        else:
            load = (gates > 0).sum(0).to(x.dtype)
        self.set_loss(self.w_importance * cv_squared(gates.sum(0)) + self.w_load * cv_squared(load))
        return idx, score

    def _prob_in_top_k(self, clean, noisy, stddev, top_logits):
        """P(expert stays in the top-k if its own noise were redrawn): Shazeer et al. eq. 9."""
        in_threshold = top_logits[:, self.top_k:self.top_k + 1]             # (T, 1) k+1-th value
        out_threshold = top_logits[:, self.top_k - 1:self.top_k]            # (T, 1) k-th value
        normal = torch.distributions.Normal(clean.new_zeros(()), clean.new_ones(()))
        is_in = noisy > in_threshold
        prob_in = normal.cdf((clean - in_threshold) / stddev)
        prob_out = normal.cdf((clean - out_threshold) / stddev)
        return torch.where(is_in, prob_in, prob_out)


def collect_aux_loss(model: nn.Module, clear: bool = False) -> torch.Tensor:
    """Sum the auxiliary losses of every gate in ``model`` (0 when there are none). (Taught in chapter 01.)

    ``clear=True`` also resets each gate's stored loss, so a later call without a new forward returns 0.
    """
    losses = []
    for module in model.modules():
        if isinstance(module, BaseGate) and module.loss is not None:
            losses.append(module.get_loss(clear=clear).reshape(()))
    if not losses:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return torch.stack(losses).sum()
