"""DeepSpeed's top-1 / top-2 / top-k gating re-derived in plain PyTorch. (Taught in chapter 02.)

Same logits in, the same expert indices, capacity slots, combine weights, ``exp_counts`` and ``l_aux`` out
as ``deepspeed.moe.sharded_moe.top1gating / top2gating / topkgating`` (0.19.8), bit for bit, with sampling
off (``use_rts=False`` or explicit ``priority``; ``top2_2nd_expert_sampling=False`` or explicit ``noise``).
Written from the algorithm, not copied; where DeepSpeed's arithmetic has a quirk that changes results
(float32 capacity, ``torch.topk`` tie order, aux-loss formula per k) the same arithmetic is used and named.

Everything returns a :class:`Routing` with per-route tensors of shape ``(k, S)``: route ``j`` of token ``s``
goes to expert ``indices[j, s]`` (``-1``: dropped) at slot ``locations[j, s]`` with weight ``weights[j, s]``.
The capacity ``C`` is :func:`labutils.moe.capacity.deepspeed_capacity` (``ds_capacity`` in this module's code, chapter
02's name; ``labutils.ds.gating.ds_capacity`` from outside warns until 1.0.0) or, without drops,
:func:`labutils.moe.capacity.deepspeed_dropless_capacity`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._deprecate import forward_moved
from ..moe.capacity import deepspeed_capacity as ds_capacity  # chapter 02's name; the formulas are the core's
from ..moe.capacity import deepspeed_dropless_capacity

__all__ = ["Routing", "top1_routing", "top2_routing", "topk_routing", "routing_from_deepspeed", "moe_output"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)


@dataclass
class Routing:
    """One gating decision. Shapes: ``k`` routes per token, ``S`` tokens, ``E`` experts, ``C`` capacity."""

    indices: torch.Tensor     # (k, S) int64 expert of each route, -1 when dropped by capacity
    locations: torch.Tensor   # (k, S) int64 slot in that expert's buffer (0 when dropped)
    weights: torch.Tensor     # (k, S) float32 combine weight (0 when dropped)
    capacity: int             # C: slots per expert
    exp_counts: torch.Tensor  # (E,) int64 routes chosen per expert, counted BEFORE capacity drops
    l_aux: torch.Tensor       # () load-balancing loss
    num_experts: int

    @property
    def kept_counts(self) -> torch.Tensor:
        """(E,) routes each expert actually processes (after drops)."""
        kept = self.indices[self.indices >= 0]
        return torch.bincount(kept, minlength=self.num_experts)

    @property
    def drop_rate(self) -> float:
        """Fraction of routes dropped by capacity."""
        return 1.0 - self.kept_counts.sum().item() / max(int(self.exp_counts.sum()), 1)

    def combine_weights(self) -> torch.Tensor:
        """Dense ``(S, E, C)`` weights, as DeepSpeed's gates return with ``sparse_routes=False``."""
        k, S = self.indices.shape
        dense = torch.zeros(S, self.num_experts, self.capacity, dtype=self.weights.dtype)
        kept = self.indices >= 0                                             # (k, S)
        token = torch.arange(S).expand(k, S)
        dense.index_put_((token[kept], self.indices[kept], self.locations[kept]), self.weights[kept],
                         accumulate=True)
        return dense

    def dispatch_mask(self) -> torch.Tensor:
        """Dense ``(S, E, C)`` bool: which slot each kept route occupies."""
        return self.combine_weights().bool()


# -- shared steps ----------------------------------------------------------------------------------

def _slots(chosen: torch.Tensor) -> torch.Tensor:
    """(S, E) 0/1 -> (S, E) arrival order of each chosen (token, expert) among that expert's tokens."""
    return torch.cumsum(chosen, dim=0) - 1


def _keep_top(priority: torch.Tensor, capacity: int) -> torch.Tensor:
    """(S, E) -> (S, E) 0/1: for each expert the ``capacity`` rows of highest priority (torch.topk's order)."""
    rows = torch.topk(priority, k=min(capacity, priority.shape[0]), dim=0).indices     # (C', E)
    return torch.zeros_like(priority, dtype=torch.int64).scatter_(0, rows, 1)


def _per_route(chosen_e: torch.Tensor, value: torch.Tensor, kept_s: torch.Tensor,
               fill: float = 0) -> torch.Tensor:
    """Pick ``value[s, chosen_e[s]]`` per token, ``fill`` where the route was dropped."""
    picked = value.gather(1, chosen_e[:, None])[:, 0]
    return torch.where(kept_s, picked, torch.full_like(picked, fill))


# -- top-1 -----------------------------------------------------------------------------------------

def top1_routing(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
                 drop_tokens: bool = True, priority: torch.Tensor | None = None) -> Routing:
    """DeepSpeed's top-1 gate (``top1gating``) on ``logits`` (S, E).

    * expert = argmax of the fp32 softmax; weight = that softmax probability (NOT renormalised);
    * ``l_aux = E * sum_e mean_s(p_se) * frac_e`` with ``frac_e`` the share of tokens choosing ``e``;
    * capacity :func:`ds_capacity` (``drop_tokens=False``: the largest expert count, at most S);
    * which tokens an over-full expert keeps: the ``C`` highest ``priority`` (``use_rts=True`` draws it
      uniform at random: ``torch.rand(S, E)``); with no priority (``use_rts=False``) all tokens tie at 1 and
      ``torch.topk``'s tie order decides, which is NOT token order.
    """
    S, E = logits.shape
    probs = F.softmax(logits.float(), dim=1)                                  # (S, E)
    expert = torch.argmax(probs, dim=1)                                       # (S,)
    chosen = F.one_hot(expert, num_classes=E)                                 # (S, E) int64
    exp_counts = chosen.sum(0)                                                # (E,) before drops
    l_aux = torch.sum(probs.mean(0) * chosen.float().mean(0)) * E
    if S < min_capacity:
        raise ValueError(f"top-1 gating needs at least min_capacity={min_capacity} tokens, got {S} "
                         "(DeepSpeed asserts the same: set min_capacity=0 or use a larger batch)")
    if drop_tokens:
        capacity = ds_capacity(S, E, capacity_factor, 1, min_capacity)
    else:
        capacity = min(deepspeed_dropless_capacity(exp_counts), S)
    ranked = chosen if priority is None else chosen * priority                # ties at 1 without RTS
    kept = chosen * _keep_top(ranked, capacity)                               # (S, E)
    kept_s = kept.sum(1).bool()                                               # (S,)
    return Routing(indices=torch.where(kept_s, expert, -1)[None],
                   locations=_per_route(expert, _slots(kept), kept_s)[None],
                   weights=_per_route(expert, probs, kept_s, 0.0)[None],
                   capacity=capacity, exp_counts=exp_counts, l_aux=l_aux, num_experts=E)


# -- top-2 -----------------------------------------------------------------------------------------

def top2_routing(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
                 drop_tokens: bool = True, noise: torch.Tensor | None = None) -> Routing:
    """DeepSpeed's top-2 gate (``top2gating``) on ``logits`` (S, E).

    * 1st expert = argmax of the softmax; 2nd = argmax of ``logits + noise`` over the other experts
      (``top2_2nd_expert_sampling=True`` draws Gumbel noise, in training AND eval; None = no noise);
    * slots in token order, all 1st choices before all 2nd choices; a route past ``C`` is dropped;
    * weights ``p1 / (p1 + p2)`` and ``p2 / (p1 + p2)`` over the routes that SURVIVED the drop, so a token
      whose 2nd route was dropped puts weight 1.0 on its 1st expert;
    * ``l_aux = mean_e(mean_s(p_se) * frac1_e) * E * E`` with ``frac1_e`` from 1st choices only;
    * ``exp_counts`` counts both routes; ``drop_tokens=False``: ``C`` = largest count (not capped at S).
    """
    S, E = logits.shape
    probs = F.softmax(logits.float(), dim=1)                                  # (S, E)
    first = torch.argmax(probs, dim=1)                                        # (S,)
    chosen1 = F.one_hot(first, num_classes=E)                                 # (S, E)
    scores2 = logits if noise is None else logits + noise
    second = torch.argmax(scores2.masked_fill(chosen1.bool(), float("-inf")), dim=1)
    chosen2 = F.one_hot(second, num_classes=E)
    slot1 = _slots(chosen1)
    slot2 = _slots(chosen2) + chosen1.sum(0, keepdim=True)                    # after every 1st choice
    l_aux = torch.mean(probs.mean(0) * chosen1.float().mean(0)) * E * E
    exp_counts = (chosen1 + chosen2).sum(0)
    if drop_tokens:
        capacity = ds_capacity(S, E, capacity_factor, 2, min_capacity)
    else:
        capacity = deepspeed_dropless_capacity(exp_counts)
    kept1 = _per_route(first, slot1, torch.ones(S, dtype=torch.bool)) < capacity   # (S,)
    kept2 = _per_route(second, slot2, torch.ones(S, dtype=torch.bool)) < capacity
    p1 = _per_route(first, probs, kept1, 0.0)
    p2 = _per_route(second, probs, kept2, 0.0)
    denom = torch.clamp(p1 + p2, min=torch.finfo(p1.dtype).eps)
    return Routing(indices=torch.stack([torch.where(kept1, first, -1), torch.where(kept2, second, -1)]),
                   locations=torch.stack([_per_route(first, slot1, kept1), _per_route(second, slot2, kept2)]),
                   weights=torch.stack([p1 / denom, p2 / denom]),
                   capacity=capacity, exp_counts=exp_counts, l_aux=l_aux, num_experts=E)


# -- top-k (k >= 3) ---------------------------------------------------------------------------------

def topk_routing(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 4,
                 drop_tokens: bool = True) -> Routing:
    """DeepSpeed's general gate (``topkgating``, drop_policy "probs"), used by ``TopKGate`` for k >= 3.

    * the k most probable experts; routes ordered best first;
    * an over-full expert keeps its ``C`` most PROBABLE tokens (not the earliest); slots in token order;
    * weights renormalised over the surviving routes; ``l_aux = mean_e(m_e * frac_e) * E * E / k`` with
      ``frac_e`` counting all k choices.
    """
    S, E = logits.shape
    probs = F.softmax(logits.float(), dim=1)                                  # (S, E)
    top_p, top_e = torch.topk(probs, k=k, dim=1)                              # (S, k)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top_e, True)
    exp_counts = chosen.sum(0)
    l_aux = torch.mean(probs.mean(0) * chosen.float().mean(0)) * E * E / k
    if drop_tokens:
        capacity = ds_capacity(S, E, capacity_factor, k, min_capacity)
        chosen_p = torch.zeros_like(probs).scatter(1, top_e, top_p)           # (S, E)
        kept = chosen & _keep_top(chosen_p, capacity).bool()
    else:
        capacity, kept = deepspeed_dropless_capacity(exp_counts), chosen
    weights = probs * kept
    weights = weights / torch.clamp(weights.sum(-1, keepdim=True), min=torch.finfo(weights.dtype).eps)
    route_kept = kept.gather(1, top_e)                                        # (S, k)
    return Routing(indices=torch.where(route_kept, top_e, -1).t(),
                   locations=(_slots(kept.long()).gather(1, top_e) * route_kept).t(),
                   weights=weights.gather(1, top_e).t(),
                   capacity=capacity, exp_counts=exp_counts, l_aux=l_aux, num_experts=E)


# -- DeepSpeed's own output, in the same shape ---------------------------------------------------------

def routing_from_deepspeed(output) -> Routing:
    """Wrap a DeepSpeed gate's ``sparse_routes=True`` tuple
    ``(l_aux, capacity, E, indices, locations, gates, exp_counts)`` as a :class:`Routing`."""
    l_aux, capacity, E, indices, locations, gates, exp_counts = output
    return Routing(indices=indices.long(), locations=locations.long(), weights=gates, capacity=int(capacity),
                   exp_counts=exp_counts.long(), l_aux=l_aux, num_experts=int(E))


def moe_output(x: torch.Tensor, routing: Routing, experts) -> torch.Tensor:
    """``y_s = sum_j weights[j, s] * experts[indices[j, s]](x_s)`` over kept routes: what the MoE layer
    computes, without capacity buffers. ``x`` (S, d); ``experts`` indexable by expert id."""
    out = torch.zeros_like(x)
    for e in range(routing.num_experts):
        route, token = (routing.indices == e).nonzero(as_tuple=True)
        if token.numel():
            w = routing.weights[route, token].to(x.dtype)[:, None]
            out = out.index_add(0, token, w * experts[e](x[token]))
    return out
