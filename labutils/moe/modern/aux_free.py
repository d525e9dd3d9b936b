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

from ..device_path import device_check


def check_expert_bias(bias: torch.Tensor, name: str = "expert_bias") -> None:
    """Raise when the ``(E,)`` selection bias holds a NaN or an infinity: a NaN wins every top-k selection (and
    -inf loses every one), so every token would go to the same experts while training carries on."""
    def error():
        bad = (~torch.isfinite(bias)).nonzero().flatten()
        return ValueError(f"{name} holds {bias[bad].tolist()} at expert(s) {bad.tolist()}: every entry must be "
                          "finite (a NaN bias sends every token to the same experts); reset it "
                          "(expert_bias.zero_()) and check bias_rate and the tokens_per_expert counts")
    device_check(torch.isfinite(bias), error, f"{name} holds NaN or inf (checked on the device)")


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


def _biased_routers(model: nn.Module) -> list:
    """``(name, module, bias, rate, counts)`` of every router in ``model`` with the three attributes of the bias:
    a :class:`TopKRouter` built with ``bias_rate``, or any module with ``expert_bias`` (a tensor), ``bias_rate``
    (not None) and ``tokens_per_expert`` (a tensor)."""
    out = []
    for name, m in model.named_modules():
        bias, rate = getattr(m, "expert_bias", None), getattr(m, "bias_rate", None)
        counts = getattr(m, "tokens_per_expert", None)
        if isinstance(bias, torch.Tensor) and rate is not None and isinstance(counts, torch.Tensor):
            out.append((name, m, bias, rate, counts))
    return out


def update_expert_bias(model: nn.Module, center: bool = True) -> int:
    """Update every :class:`TopKRouter` with a bias in ``model`` from its ``tokens_per_expert`` and reset the
    counts; returns how many routers were updated. Call it after ``optimizer.step()`` (or register it with
    :func:`attach_bias_update`). Refuses a bias holding NaN/inf and a rate that is not a finite number >= 0."""
    n = 0
    with torch.no_grad():
        for name, _, bias, rate, counts in _biased_routers(model):  # a TopKRouter, or the same three attributes
            check_expert_bias(bias, f"{name or type(model).__name__}.expert_bias")
            if counts.sum() > 0:
                bias.copy_(bias_update(bias, counts, rate, center))
            counts.zero_()
            n += 1
    return n


def attach_bias_update(optimizer: torch.optim.Optimizer, model: nn.Module, center: bool = True, *,
                       allow_none: bool = False):
    """Run :func:`update_expert_bias` before every ``optimizer.step()`` (torchtitan's step pre-hook): the counts
    then hold exactly the step's forward passes. Returns the hook handle (``.remove()`` to detach).

    Refuses, when it is attached: a ``model`` that is not an ``nn.Module`` (TypeError), and (ValueError) a
    ``model`` with no router that has a bias (a :class:`TopKRouter` built with ``bias_rate``, or a module with
    ``expert_bias``, ``bias_rate`` and ``tokens_per_expert``): the hook would never move a bias, silently.
    ``allow_none=True`` accepts such a model (the hook then does nothing), for a caller that attaches the same
    way to every variant, dense ones included."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach_bias_update: model must be an nn.Module holding the router(s), got "
                        f"{type(model).__name__}")
    if not allow_none and not _biased_routers(model):
        routers = [name or type(m).__name__ for name, m in model.named_modules()
                   if hasattr(m, "bias_rate") or hasattr(m, "expert_bias")]
        found = (f"its router(s) {routers} have no bias (built with bias_rate=None)" if routers
                 else "it holds no router")
        raise ValueError(f"attach_bias_update: model ({type(model).__name__}) has no router with an "
                         f"auxiliary-loss-free bias: {found}, so the hook would never move a bias. Expected a "
                         "module holding a TopKRouter built with bias_rate=... (e.g. ModernMoE(..., "
                         "bias_rate=1e-3)); pass allow_none=True to attach to a model that may have none")

    def hook(*args, **kwargs):
        update_expert_bias(model, center)

    return optimizer.register_step_pre_hook(hook)
