"""Gates: which experts each token goes to, and with what weight. (Taught in chapter 01.)

Every gate follows fastmoe's contract: ``gate(d_model, num_expert, world_size, top_k)`` builds it and
``gate(x)`` with ``x`` of shape ``(T, d_model)`` returns ``(gate_top_k_idx, gate_score)`` in fastmoe's shapes:

* ``NaiveGate`` (and GShard, Switch, DC, Swipe): ``(T, top_k)`` int64 ids and ``(T, top_k)`` scores (softmax
  over the k chosen logits);
* ``NoisyGate`` and ``ZeroGate`` (``balance_gates.py``): flat ``(T*top_k,)`` ids and ``(T, 1, top_k)`` scores.

An id is a GLOBAL expert id in ``0 .. world_size*num_expert-1``, or ``-1`` when the choice was dropped (over
capacity, or not sampled). The layer reshapes either form to ``(T, k)``.
A gate's auxiliary (load-balancing) loss is stored with ``set_loss`` and read with ``get_loss``;
:func:`collect_aux_loss` sums them over a whole model. The capacity-limited gates (GShard, Switch) live in
``capacity_gates.py``; ZeroGate, DCGate and SwipeGate in ``balance_gates.py``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .device_path import device_check
from .functions import check_top_k


def check_gate_input(gate: nn.Module, x, d_model: int, dtype: torch.dtype | None = None) -> None:
    """A gate's input must be a floating ``(T, d_model)`` tensor in the gate's dtype; else a clear error."""
    name = type(gate).__name__
    if not torch.is_tensor(x):
        raise TypeError(f"{name} expects a tensor of shape (tokens, d_model={d_model}), got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != d_model:
        raise ValueError(f"{name}(d_model={d_model}) got input of shape {tuple(x.shape)}; expected "
                         f"(tokens, d_model={d_model})")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} holds {dtype} weights but got a {x.dtype} input: convert one of them "
                        f"(e.g. gate.to({dtype}) or x.to({dtype}))")


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a router weight stored as fastmoe stores it, ``w`` of shape ``(d_model, E)``: ``(T, E)``.

    Computed as ``F.linear(x, w.t().contiguous())`` (a copy of the ``E x d`` weight per call): the same product,
    equal up to float rounding, in the layout the CPU's GEMM runs fastest for a narrow ``E``, forward and
    backward. ``benchmarks/step_cuts.py`` times it against ``x @ w`` inside the whole gate (chapter 08 §10: the
    router is a large part of a small MoE's step).
    """
    if not (torch.is_tensor(x) and torch.is_tensor(w)):
        raise TypeError(f"router_logits(x, w) takes two tensors, got {type(x).__name__} and {type(w).__name__}")
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"router_logits: w must be (d_model, E) with d_model = x.shape[-1]; got x of shape "
                         f"{tuple(x.shape)} and w of shape {tuple(w.shape)} (an (E, d_model) weight, as "
                         "nn.Linear stores it, is F.linear(x, w) instead)")
    return F.linear(x, w.t().contiguous())                                  # (T, E)


def check_finite_logits(gate: nn.Module, logits: torch.Tensor) -> None:
    """Raise naming the tokens whose gate logits are NaN/inf: one such token would make the whole batch's
    balancing loss NaN (and its routing meaningless)."""
    if not logits.numel():
        return

    def error():
        bad = (~torch.isfinite(logits)).any(dim=1).nonzero().flatten().tolist()
        shown = ", ".join(str(t) for t in bad[:10]) + (", ..." if len(bad) > 10 else "")
        return ValueError(f"{type(gate).__name__}: the gate logits of {len(bad)} of {logits.shape[0]} tokens are "
                          f"NaN or inf (token indices {shown}); the balancing loss of the whole batch would be NaN. "
                          f"Check those input rows (and the gate weights) for NaN/inf")
    device_check(torch.isfinite(logits), error, f"{type(gate).__name__}: gate logits hold NaN or inf (checked on the "
                                           "device; run on the CPU to see which tokens)")


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


class NaiveGate(BaseGate):
    """A linear layer, top-k of its logits, softmax over the k chosen logits. Its loss is a dummy ``(1,)`` zero,
    as in fastmoe. ``return_all_scores=True`` also returns the ``(T, tot_expert)`` logits."""

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2, gate_bias: bool = True):
        super().__init__(num_expert, world_size)
        check_top_k(top_k, self.tot_expert)
        self.d_model = d_model
        self.gate = nn.Linear(d_model, self.tot_expert, bias=gate_bias)
        self.top_k = top_k

    def top_k_logits(self, x):
        """``(idx, score, logits)``: ``(T, k)`` ids best first, ``(T, k)`` softmax over them, ``(T, E)`` logits."""
        if isinstance(self.gate, nn.Linear):  # (a student may swap in nn.Identity to feed logits straight in)
            check_gate_input(self, x, self.gate.in_features, self.gate.weight.dtype)
        logits = self.gate(x)                                               # (T, E)
        top_val, top_idx = torch.topk(logits, k=self.top_k, dim=-1)         # (T, k), sorted best first
        return top_idx, F.softmax(top_val, dim=-1), logits

    def forward(self, x, return_all_scores: bool = False):
        idx, score, logits = self.top_k_logits(x)
        self.set_loss(logits.new_zeros(1, requires_grad=True))              # fastmoe's dummy loss, shape (1,)
        if return_all_scores:
            return idx, score, logits
        return idx, score


def cv_squared(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation ``var(x) / mean(x)^2`` (Shazeer et al. 2017); a ``(1,)`` zero for one
    element (fastmoe's shapes)."""
    if x.numel() <= 1:
        return x.new_zeros(1, dtype=torch.float32)
    x = x.float()
    return x.var() / (x.mean() ** 2 + eps)


class NoisyGate(BaseGate):
    """Noisy top-k gating (Shazeer et al. 2017, "Outrageously large neural networks"), as fastmoe computes it.

    logits = x W_g + N(0,1) * (softplus(x W_noise) + 0.01) (noise only in training); softmax over the top-k.
    Loss = ``cv²(importance) + cv²(load)``: importance is the summed gate weight per expert; load the
    differentiable expected number of tokens per expert (probability of staying in the top-k under fresh
    noise), or the plain count when there is no noise (eval) or ``top_k == tot_expert``.
    Returns fastmoe's shapes: flat ``(T*k,)`` ids and ``(T, 1, k)`` scores.
    ``w_importance``/``w_load`` (lab additions, default 1) weight the two terms.
    """

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 noise_epsilon: float = 1e-2, w_importance: float = 1.0, w_load: float = 1.0):
        super().__init__(num_expert, world_size)
        check_top_k(top_k, self.tot_expert)
        self.d_model = d_model
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
        clean, logits, stddev = self.noisy_logits(x)                        # router: (T, E) each
        top_logits, idx, score = self.top_k_choice(logits)                  # (T, k+1), (T, k), (T, k)
        self.set_loss(self.balance_loss(clean, logits, stddev, top_logits, idx, score))
        return idx.reshape(-1), score.unsqueeze(1)                          # (T*k,), (T, 1, k)

    def noisy_logits(self, x):
        """The router: ``(clean, logits, stddev)``, each ``(T, E)``; ``logits`` is ``clean`` plus noise in
        training (``stddev`` is ``None`` in eval)."""
        check_gate_input(self, x, self.d_model, self.w_gate.dtype)
        clean = router_logits(x, self.w_gate)                               # (T, E)
        check_finite_logits(self, clean)
        if self.training:
            stddev = F.softplus(router_logits(x, self.w_noise)) + self.noise_epsilon  # (T, E)
            return clean, clean + torch.randn_like(clean) * stddev, stddev
        return clean, clean, None  # fastmoe multiplies the noise by 0 (and still draws it); the values are the same

    def top_k_choice(self, logits):
        """``(top_logits (T, m), idx (T, k), score (T, k))``: the best ``m = min(k + 1, E)`` logits (the
        ``k+1``-th is the load estimate's threshold), the chosen ids and the softmax over their logits."""
        m = min(self.top_k + 1, self.tot_expert)
        top_logits, top_idx = logits.topk(m, dim=-1)                        # (T, m)
        return top_logits, top_idx[:, :self.top_k], F.softmax(top_logits[:, :self.top_k], dim=-1)

    def balance_loss(self, clean, logits, stddev, top_logits, idx, score):
        """``w_importance * cv²(importance) + w_load * cv²(load)`` (a scalar, or fastmoe's ``(1,)`` zero)."""
        gates = torch.zeros_like(logits).scatter(1, idx, score)             # (T, E), dense weights
        if stddev is not None and self.top_k < self.tot_expert:
            load = self._prob_in_top_k(clean, logits, stddev, top_logits).sum(0)
        else:
            load = (gates > 0).sum(0)
        return self.w_importance * cv_squared(gates.sum(0)) + self.w_load * cv_squared(load)

    def _prob_in_top_k(self, clean, noisy, stddev, top_logits):
        """P(expert stays in the top-k if its own noise were redrawn): Shazeer et al. eq. 9."""
        in_threshold = top_logits[:, self.top_k:self.top_k + 1]             # (T, 1) k+1-th value
        out_threshold = top_logits[:, self.top_k - 1:self.top_k]            # (T, 1) k-th value
        is_in = noisy > in_threshold                                        # (T, E)
        # where(is_in, cdf(z_in), cdf(z_out)) with ONE cdf: elementwise, so the same values and gradients
        threshold = torch.where(is_in, in_threshold, out_threshold)         # (T, E)
        return _std_normal_cdf((clean - threshold) / stddev)


def _std_normal_cdf(z: torch.Tensor) -> torch.Tensor:
    """``Normal(0, 1).cdf(z)`` as torch.distributions computes it, ``0.5 * (1 + erf((z - 0) * 1 / sqrt 2))``,
    without building a distribution object per call (its ``- 0`` and ``* 1`` are exact, so the values and
    gradients are the same bits)."""
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def collect_aux_loss(model: nn.Module, clear: bool = False) -> torch.Tensor:
    """Sum the auxiliary losses of every loss source in ``model`` (0 when there are none). (Taught in chapter 01.)

    A loss source is any module with fastmoe's gate interface, ``get_loss(clear)`` and ``has_loss``: the lab's
    gates, real fastmoe's gates, and ``labutils.models.DeepSpeedFFN`` (which keeps DeepSpeed's ``l_aux``).
    ``clear=True`` also resets each stored loss, so a later call without a new forward returns 0; the trainer
    (chapter 03) reads with ``clear=True`` once per step.
    """
    losses = []
    for module in model.modules():
        get_loss = getattr(module, "get_loss", None)
        if callable(get_loss) and getattr(module, "has_loss", False):
            loss = get_loss(clear=clear)
            losses.append(torch.as_tensor(loss).reshape(()))
    if not losses:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return torch.stack(losses).sum()
