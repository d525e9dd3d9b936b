"""Expert-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"). (Chapter 09.)

Token choice lets each token pick k experts; expert choice turns the score matrix around: ``S = softmax(X W)``
``(T, E)``, then each expert takes the ``C`` tokens with the highest score in its column,
``G, I = top_C(S^T)`` ``(E, C)``. Every expert gets exactly ``C = ceil(T * capacity_factor / E)`` tokens
(:func:`labutils.moe.capacity.expert_capacity`): perfect balance by construction, and a token may get 0, 1 or
many experts.

The causality caveat: the top-C is over ALL tokens of the batch, so whether token t gets an expert depends on the
scores of tokens after it. A causal language model trained this way sees the future through the router
(chapter 09 shows an earlier token's output change when a later token is edited); at generation time, with
one token at a time, the routing is not the one it was trained with.
"""
from __future__ import annotations

import numbers

import torch

from ..._deprecate import forward_moved
from ..device_path import device_check

__all__ = ["expert_choice_route"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)


def expert_choice_route(scores: torch.Tensor, capacity: int):
    """``scores`` ``(T, E)`` -> ``(token_idx (E, C), gates (E, C))``: expert e's C best tokens and their scores.
    Ties go to the earlier token (``torch.topk`` order on CPU is not promised; a stable sort is used).

    Refuses, naming the argument and the value: ``scores`` that are not ``(T, E)`` or hold NaN/inf;
    ``capacity`` not an int (TypeError: 2.5 failed inside the slicing) or not between 1 and ``T`` (0 only for
    an empty batch, ``T = 0``: every expert takes no token, as :func:`labutils.moe.capacity.expert_capacity` gives)."""
    if scores.dim() != 2:
        raise ValueError(f"expert_choice_route needs scores (tokens, experts), got {tuple(scores.shape)}")
    T = scores.shape[0]
    def error():  # a NaN sorts above every score: that token would take a slot at every expert
        bad = (~torch.isfinite(scores)).any(1).nonzero().flatten()                          # tokens with NaN/inf
        return ValueError(f"expert_choice_route: scores of token(s) {bad[:10].tolist()} (of {T}) are NaN or "
                          "infinite (a NaN in the router input x?); every score must be finite, or that token "
                          "takes the first slot of every expert")
    device_check(torch.isfinite(scores), error, "expert_choice_route: scores hold NaN or inf (checked on the device)")
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"expert_choice_route: capacity must be an int between 1 and the number of tokens {T} "
                        f"(expert_capacity(T, E, capacity_factor) gives it), got {capacity!r} "
                        f"({type(capacity).__name__})")
    if not (1 <= capacity <= T or capacity == T == 0):
        raise ValueError(f"capacity={capacity} must be between 1 and the number of tokens {T}")
    order = torch.sort(scores.t(), dim=1, descending=True, stable=True).indices[:, :capacity]  # (E, C)
    return order, scores.t().gather(1, order)                                                  # (E, C) x2
