"""The router's auxiliary losses: the balancing loss (batch- or sequence-level) and ST-MoE's z-loss.
(Taught in chapter 09.)

* :func:`balance_loss`: ``sum_i f_i * P_i`` with ``f_i = E/(k T) * #(tokens choosing i)`` and ``P_i`` the mean
  normalised score of expert ``i``: DeepSeek-V3's eq. 17-20 (``seq_len=None`` is the batch-wide, Switch-style
  form; ``seq_len=L`` averages it over sequences of ``L`` tokens: the "complementary sequence-wise" loss). It is
  1 when every expert gets ``1/E`` of choices and of scores; its gradient flows through ``P`` only.
* :func:`z_loss`: ``mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al. 2022, eq. 5): keeps router logits small.
"""
from __future__ import annotations

import torch


def _check(scores: torch.Tensor, idx: torch.Tensor) -> None:
    if scores.dim() != 2 or idx.dim() != 2 or idx.shape[0] != scores.shape[0]:
        raise ValueError(f"balance_loss needs scores (T, E) and idx (T, k) with the same T, got "
                         f"{tuple(scores.shape)} and {tuple(idx.shape)}")


def balance_loss(scores: torch.Tensor, idx: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    """``scores`` ``(T, E)`` router scores (softmax or sigmoid), ``idx`` ``(T, k)`` chosen experts -> ``()``.

    Scores are normalised to sum to 1 per token before averaging (DeepSeek-V3's ``s'``; a no-op for softmax).
    ``seq_len``: the loss per sequence of that many consecutive tokens, averaged over sequences.
    """
    _check(scores, idx)
    T, E = scores.shape
    k = idx.shape[1]
    L = T if seq_len is None else int(seq_len)
    if L <= 0 or T % L:
        raise ValueError(f"seq_len={seq_len} must be a positive divisor of the {T} tokens")
    probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)          # (T, E)
    chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0)                  # (T, E) 0/1, no gradient
    f = chosen.reshape(T // L, L, E).sum(1) * (E / (k * L))                  # (S, E), 1 = balanced
    P = probs.reshape(T // L, L, E).mean(1)                                  # (S, E)
    return (f.detach() * P).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean over tokens of logsumexp(logits)^2``; ``logits`` ``(T, E)`` -> ``()``."""
    if logits.dim() != 2:
        raise ValueError(f"z_loss needs router logits of shape (tokens, experts), got {tuple(logits.shape)}")
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
