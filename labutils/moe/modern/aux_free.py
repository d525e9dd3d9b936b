"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3 section 2.1.2). (Taught in chapter 09.)

Each expert has a bias ``b_i`` added to its score for the top-k *selection* only. After each step,
``b_i += gamma * sign(mean_j c_j - c_i)``: an overloaded expert (``c_i`` above the mean) becomes less likely
to be picked, an underloaded one more. No gradient, no loss term: the task gradient is left alone.
torchtitan (``components/optimizer/optimizer.py``, ``_update_expert_bias``) also subtracts the mean of the
step from the update (``center=True``); DeepSeek-V3's paper does not.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn


def check_expert_bias(bias: torch.Tensor, name: str = "expert_bias") -> None:
    """Raise when the ``(E,)`` selection bias holds a NaN or an infinity: a NaN wins every top-k selection (and
    -inf loses every one), so every token would go to the same experts while training carries on."""
    bad = (~torch.isfinite(bias)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"{name} holds {bias[bad].tolist()} at expert(s) {bad.tolist()}: every entry must be "
                         "finite (a NaN bias sends every token to the same experts); reset it "
                         "(expert_bias.zero_()) and check bias_rate and the tokens_per_expert counts")


def bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float, center: bool = True) -> torch.Tensor:
    """The new ``(E,)`` bias after one step with per-expert choice ``counts`` ``(E,)`` (pure function)."""
    if bias.shape != counts.shape or bias.dim() != 1:
        raise ValueError(f"bias and counts must both be (num_experts,), got {tuple(bias.shape)} and "
                         f"{tuple(counts.shape)}")
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"rate (the bias step gamma) must be a finite number >= 0, got {rate!r}")
    check_expert_bias(bias, "bias")
    if not bool(torch.isfinite(counts.float()).all()):
        raise ValueError(f"counts must be finite per-expert choice counts, got {counts.tolist()}")
    counts = counts.float()
    delta = rate * torch.sign(counts.mean() - counts)                  # (E,) +rate if underloaded
    if center:
        delta = delta - delta.mean()
    return bias + delta


def update_expert_bias(model: nn.Module, center: bool = True) -> int:
    """Update every :class:`TopKRouter` with a bias in ``model`` from its ``tokens_per_expert`` and reset the
    counts; returns how many routers were updated. Call it after ``optimizer.step()`` (or register it with
    :func:`attach_bias_update`)."""
    n = 0
    with torch.no_grad():
        for name, m in model.named_modules():  # a TopKRouter, or any router with the same three attributes
            bias, rate = getattr(m, "expert_bias", None), getattr(m, "bias_rate", None)
            counts = getattr(m, "tokens_per_expert", None)
            if not isinstance(bias, torch.Tensor) or rate is None or not isinstance(counts, torch.Tensor):
                continue
            check_expert_bias(bias, f"{name or type(model).__name__}.expert_bias")
            if counts.sum() > 0:
                bias.copy_(bias_update(bias, counts, rate, center))
            counts.zero_()
            n += 1
    return n


def attach_bias_update(optimizer: torch.optim.Optimizer, model: nn.Module, center: bool = True):
    """Run :func:`update_expert_bias` before every ``optimizer.step()`` (torchtitan's step pre-hook): the counts
    then hold exactly the step's forward passes. Returns the hook handle (``.remove()`` to detach)."""
    def hook(*args, **kwargs):
        update_expert_bias(model, center)

    return optimizer.register_step_pre_hook(hook)
