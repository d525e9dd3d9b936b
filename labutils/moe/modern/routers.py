"""Token-choice top-k router as DeepSeek-V3 and torchtitan define it. (Taught in chapter 09.)

``logits = x W`` (no bias); ``s = score_func(logits)`` (``softmax`` over experts, or ``sigmoid`` per expert);
the top-k are chosen on ``s + expert_bias`` (the auxiliary-loss-free bias, selection only) but weighted by
``s`` itself; ``route_norm`` divides the k weights by their sum; ``route_scale`` multiplies them
(torchtitan's ``TokenChoiceTopKRouter``: ``score_func``, ``route_norm``, ``route_scale``).

The router keeps fastmoe's gate interface (``tot_expert``, ``set_loss``/``get_loss``), so
``collect_aux_loss`` and the trainer's ``ExpertLoadRecorder`` see it. Its stored loss is already weighted:
``balance_coef * balance_loss + z_coef * z_loss`` (train with ``aux_coef=1``).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ..device_path import bincount
from ..gates import BaseGate, check_finite_logits, check_gate_input
from .aux_free import check_expert_bias
from .losses import balance_loss, z_loss

SCORE_FUNCS = ("softmax", "sigmoid")
BALANCE_KINDS = ("none", "batch", "sequence")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_weight(name: str, value, bound: str) -> None:
    """A finite number ``> 0`` or ``>= 0`` (``bound``), or a ValueError naming ``name`` and the value."""
    ok = _real(value) and math.isfinite(value) and (value > 0 if bound == "> 0" else value >= 0)
    if not ok:
        raise ValueError(f"TopKRouter: {name} must be a finite number {bound}, got {value!r}")


class TopKRouter(BaseGate):
    """``router(x, seq_len=None)`` with ``x`` ``(T, d)`` -> ``(idx (T, k), weights (T, k), scores (T, E))``.

    * ``score_func``, ``route_norm``, ``route_scale``: as torchtitan's router (above).
    * ``bias_rate``: ``None`` (no bias) or the step ``gamma`` of the auxiliary-loss-free bias (``expert_bias``
      buffer, updated by :func:`labutils.moe.modern.aux_free.update_expert_bias` after each optimiser step).
    * ``balance``: ``"none"``, ``"batch"`` or ``"sequence"`` balancing loss, weighted by ``balance_coef``.
    * ``z_coef``: weight of the ST-MoE z-loss (0 = off).
    While training, ``tokens_per_expert`` accumulates the choices per expert (what the bias update reads).

    Refused at construction, naming the argument and the value: an unknown ``score_func`` or ``balance``;
    ``top_k`` not an int (TypeError: torch's ``topk`` failed at the first forward) or not between 1 and
    ``num_experts``; ``route_scale`` not a finite number > 0 (NaN made every weight NaN); ``balance_coef`` and
    ``z_coef`` not finite numbers >= 0 (NaN made the aux loss NaN); ``bias_rate`` neither None nor a finite
    number > 0.
    """

    expert_bias: torch.Tensor | None     # (E,) buffer, or None without bias_rate
    tokens_per_expert: torch.Tensor      # (E,) buffer

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0, bias_rate: float | None = None,
                 balance: str = "none", balance_coef: float = 0.01, z_coef: float = 0.0):
        super().__init__(num_experts, 1)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if balance not in BALANCE_KINDS:
            raise ValueError(f"balance must be one of {BALANCE_KINDS}, got {balance!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"TopKRouter: top_k must be an int between 1 and num_experts={num_experts}, got "
                            f"{top_k!r} ({type(top_k).__name__})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if bias_rate is not None and not (_real(bias_rate) and math.isfinite(bias_rate) and bias_rate > 0):
            raise ValueError(f"bias_rate must be None or a finite number > 0, got {bias_rate!r}")
        _check_weight("route_scale", route_scale, "> 0")
        _check_weight("balance_coef", balance_coef, ">= 0")
        _check_weight("z_coef", z_coef, ">= 0")
        self.d_model, self.top_k = d_model, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, float(route_scale)
        self.bias_rate, self.balance, self.balance_coef, self.z_coef = bias_rate, balance, balance_coef, z_coef
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts) if bias_rate is not None else None)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.last_logits: torch.Tensor | None = None   # (T, E), detached: what chapter 09 plots

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """``(T, E)`` logits -> ``(T, E)`` scores (float32)."""
        logits = logits.float()
        return torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)

    def forward(self, x: torch.Tensor, seq_len: int | None = None):
        check_gate_input(self, x, self.d_model, self.gate.weight.dtype)
        logits = self.gate(x)                                                # (T, E)
        check_finite_logits(self, logits)
        s = self.scores(logits)                                              # (T, E)
        if self.expert_bias is not None:
            check_expert_bias(self.expert_bias)                              # a NaN would win every selection
        choice = s if self.expert_bias is None else s + self.expert_bias     # selection only
        idx = choice.topk(self.top_k, dim=-1).indices                        # (T, k)
        w = s.gather(1, idx)                                                 # (T, k) from the unbiased scores
        if self.route_norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.route_scale
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += bincount(idx, self.tot_expert).float()
        self.last_logits = logits.detach()
        self.set_loss(self.aux_loss(logits, s, idx, seq_len))
        return idx, w.to(x.dtype), s

    def expert_choice_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Expert choice's scores: ``x`` ``(T, d)`` -> softmax ``(T, E)`` (float32); stores the logits and, with
        ``z_coef``, the z-loss (no balance loss, no bias: each expert takes ``C`` tokens)."""
        logits = self.gate(x)                                                # (T, E)
        self.last_logits = logits.detach()
        if self.z_coef:
            self.set_loss(self.z_coef * z_loss(logits))
        return torch.softmax(logits.float(), -1)

    def logit_stats(self) -> dict:
        """``logit_rms``, ``logit_max``, ``lse2`` (the z-loss) of the last forward's logits, as 0-d float32
        tensors where the logits are (no host read: ``float()`` them when needed); zeros before a forward."""
        logits = self.last_logits
        if logits is None:
            zero = torch.zeros((), device=self.gate.weight.device)
            return dict(logit_rms=zero, logit_max=zero, lse2=zero)
        logits = logits.float()
        return dict(logit_rms=logits.pow(2).mean().sqrt(), logit_max=logits.abs().max(), lse2=z_loss(logits))

    def aux_loss(self, logits, s, idx, seq_len) -> torch.Tensor:
        loss = logits.new_zeros((), dtype=torch.float32)
        if self.balance != "none":
            loss = loss + self.balance_coef * balance_loss(s, idx, seq_len if self.balance == "sequence" else None)
        if self.z_coef:
            loss = loss + self.z_coef * z_loss(logits)
        return loss
