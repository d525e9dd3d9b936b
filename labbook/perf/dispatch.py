"""Ways to run an MoE layer's experts, on identical weights and routing. (Taught in chapter 08.)

Every design computes the same function: token ``t`` goes to its ``k`` chosen experts, each a two-layer MLP
``d -> h -> GELU -> d`` with fastmoe's weight layout ``w1 (E, h, d), b1 (E, h), w2 (E, d, h), b2 (E, d)``, and
the outputs are summed with the gate scores. They differ only in how tokens reach their experts:

=================  ==================================================================  ==================
design             how                                                                 extra work
=================  ==================================================================  ==================
``loop``           for each expert: ``torch.where`` its tokens, run it, ``index_add_``    E small launches
``core``           the lab's FastMoE core: sort by expert, one buffer, gather back      a sort, 2 copies
``padded``         ``[E, C, d]`` buffer (C = busiest expert's count), batched matmul    E*C - N pad rows
``grouped_mm``     sorted rows, ``torch._grouped_mm`` with group ends ``offs``         (kernel quality)
``einsum``         GShard's one-hot ``(T, E, C)`` dispatch and combine tensors         O(T*E*C*d) flops
``ds_cf1/ds_cf2``  DeepSpeed's ``MoE`` layer, capacity factor 1.0 / 2.0                 drops or pad rows
``fastmoe``        the real fastmoe's ``FMoETransformerMLP`` (CUDA only, when importable)   -
=================  ==================================================================  ==================

and two references: ``dense`` (one MLP ``d -> k*h -> d`` doing the same FLOPs) and ``separate`` (E independent
MLPs on tokens that are already sliced per expert: matmuls only). They are yardsticks, not limits: a design can
beat them (``grouped_mm`` runs all experts in one call and can beat ``separate``'s E calls at few tokens per
expert), and chapter 08 says where one does.

Routing is shared: :func:`~labbook.perf.problem.route` turns the same ``logits (T, E)`` into ``(idx, score)``
with DeepSpeed's convention, so DeepSpeed's layer, fed the same logits, computes the same output wherever it
drops nothing. The problem and the step live in :mod:`labbook.perf.problem`, the designs that are whole layers
(``core``, ``ds_cf*``, ``fastmoe``) in :mod:`labbook.perf.real_layers`; this module is the catalogue: the
designs written here, the references, and :func:`build_designs` over all of them. The loop and grouped designs
are also functions of any routing and weights (:func:`loop_moe`, :func:`grouped_moe`), which the layer speed
table's rows (:mod:`labbook.perf.layer_bench`) call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labutils._deprecate import forward_moved
from labutils.moe.capacity import position_in_expert
from labutils.moe.dispatch import dispatch
from labutils.moe.expert_mlp import grouped_mlp
from labutils.moe.functions import combine, count_by_gate, gather, scatter

from .problem import DispatchOut, Problem, expert_mlp, route
from .real_layers import CoreMoE, DeepSpeedMoE, fastmoe

__all__ = ["loop", "loop_moe", "padded", "grouped_mm", "grouped_moe", "einsum", "dense", "separate", "DESIGNS",
           "REFERENCES", "build_designs"]
forward_moved(__name__)  # the problem's and the real layers' names: labbook.perf.problem, labbook.perf.real_layers


# ---- the designs ------------------------------------------------------------------------------
def loop_moe(x: torch.Tensor, idx: torch.Tensor, score: torch.Tensor, experts) -> torch.Tensor:
    """Naive: for each expert find its (token, choice) pairs, run it on them, add the weighted result.

    ``x (T, d)``, ``idx``/``score (T, k)``, ``experts``: one ``(w1 (h, d), b1 (h,), w2 (d, h), b2 (d,))`` per
    expert. Returns ``(T, d)``.
    """
    y = torch.zeros_like(x)                                                # (T, d)
    for e, weights in enumerate(experts):
        tok, choice = torch.where(idx == e)                                # (n_e,), (n_e,)
        if tok.numel():
            out = expert_mlp(x[tok], *weights)                             # (n_e, d)
            y.index_add_(0, tok, out * score[tok, choice].unsqueeze(1).to(out.dtype))
    return y


def loop(p: Problem) -> DispatchOut:
    """The naive loop (:func:`loop_moe`) on the problem: the reference every design is checked against.

    The stacked weights are ``unbind``-ed once: indexing ``w1[e]`` inside the loop would make every expert's
    backward write a full-size ``(E, h, d)`` zero gradient, O(E^2) work (tens of times slower at E=64).
    """
    idx, score = route(p.logits, p.top_k)                                  # (T, k), (T, k)
    experts = list(zip(p.w1.unbind(0), p.b1.unbind(0), p.w2.unbind(0), p.b2.unbind(0)))
    return DispatchOut(loop_moe(p.x, idx, score, experts), idx.numel(), idx.numel())


def padded(p: Problem) -> DispatchOut:
    """Copy each expert's rows into an ``[E, C, d]`` buffer (C = busiest expert) and run two batched matmuls.

    A sorted row's slot is its index minus its expert's first row (the rows are already sorted by expert, so no
    second sort: :func:`~labutils.moe.capacity.position_in_expert` gives the same slots from the unsorted choices).
    """
    idx, score = route(p.logits, p.top_k)
    pos, counts = count_by_gate(idx, p.E)                                  # (N,), (E,)
    expert = idx.reshape(-1)[pos]                                          # (N,) expert of each sorted row
    slot = torch.arange(pos.numel(), device=idx.device) - (counts.cumsum(0) - counts)[expert]  # (N,)
    C = int(counts.max())
    buf = p.x.new_zeros(p.E, C, p.d).index_put((expert, slot), scatter(p.x, pos, p.top_k))  # (E, C, d)
    hid = F.gelu(torch.baddbmm(p.b1.unsqueeze(1), buf, p.w1.transpose(1, 2)))              # (E, C, h)
    out = torch.baddbmm(p.b2.unsqueeze(1), hid, p.w2.transpose(1, 2))                      # (E, C, d)
    y = combine(gather(out[expert, slot], pos, idx.numel()), score)                         # (T, d)
    return DispatchOut(y, idx.numel(), p.E * C)


def grouped_moe(x: torch.Tensor, idx: torch.Tensor, score: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Sorted rows and one grouped GEMM per linear: the lab's dispatcher (:func:`~labutils.moe.dispatch.dispatch`)
    with the grouped backend's experts (:func:`~labutils.moe.expert_mlp.grouped_mlp`, ``torch._grouped_mm``), what
    ``FMoETransformerMLP(backend="grouped")`` runs: ``x (T, d)``, ``idx``/``score (T, k)``, fastmoe's weight
    layout ``w1 (E, h, d), b1 (E, h), w2 (E, d, h), b2 (E, d)``. Returns ``(T, d)``.

    Constraints (torch 2.13): float32, bfloat16 or float16 (not float64); empty groups are fine; offsets are the
    int32 cumulative group ends (``grouped_matmul`` makes them from ``counts``); its backward needs a contiguous
    incoming gradient (``y.sum().backward()`` fails); rows and weight strides 16-byte aligned, on the CPU too
    (``d`` and ``h`` multiples of 4 in float32: found by the property-based test); on CUDA sm90+.
    """
    d, h, per_row = x.shape[1], w1.shape[1], 16 // x.element_size()
    if d % per_row or h % per_row:
        raise ValueError(f"grouped_mm needs 16-byte aligned rows: d_model={d} and d_hidden={h} must be "
                         f"multiples of {per_row} for {x.dtype}")
    def experts(xs, counts):                                               # sorted rows (N, d) -> (N, d)
        return [grouped_mlp(xs[0], counts, w1, b1, w2, b2, F.gelu)]
    return dispatch([x], idx, score, experts, num_expert=w1.shape[0])[0]   # (T, d)


def grouped_mm(p: Problem) -> DispatchOut:
    """The grouped design (:func:`grouped_moe`) on the problem: group ``e`` is the sorted rows of expert ``e``."""
    idx, score = route(p.logits, p.top_k)
    return DispatchOut(grouped_moe(p.x, idx, score, p.w1, p.b1, p.w2, p.b2), idx.numel(), idx.numel())


def einsum(p: Problem, capacity_factor: float | None = None) -> DispatchOut:
    """GShard: one-hot dispatch ``(T, E, C)`` and combine tensors, applied with einsums.

    Choices are placed choice-major (every token's first choice before any second choice), as in GShard: the
    core's :func:`~labutils.moe.capacity.position_in_expert`. ``capacity_factor=None`` sizes C for the busiest
    expert (drops nothing); otherwise ``C = ceil(cf*T*k/E)`` and choices beyond C are dropped.
    """
    idx, score = route(p.logits, p.top_k)
    T, k = idx.shape
    onehot = F.one_hot(idx.t().reshape(-1), p.E)                           # (k*T, E) choice-major
    loc = position_in_expert(idx, p.E).t().reshape(-1)                     # (k*T,) row within its expert
    counts = onehot.sum(0)
    C = int(counts.max()) if capacity_factor is None else math.ceil(capacity_factor * T * k / p.E)
    keep = loc < C                                                         # (k*T,)
    slot = F.one_hot(loc.clamp(max=C - 1), C) * keep.unsqueeze(1)          # (k*T, C)
    route_e = onehot.to(p.x.dtype).view(k, T, p.E)
    dispatch = torch.einsum("kte,ktc->tec", route_e, slot.to(p.x.dtype).view(k, T, C))     # (T, E, C) 0/1
    weights = route_e * score.t().unsqueeze(-1).to(p.x.dtype)                             # (k, T, E)
    comb = torch.einsum("kte,ktc->tec", weights, slot.to(p.x.dtype).view(k, T, C))         # (T, E, C)
    xe = torch.einsum("tec,td->ecd", dispatch, p.x)                        # (E, C, d)
    hid = F.gelu(torch.baddbmm(p.b1.unsqueeze(1), xe, p.w1.transpose(1, 2)))               # (E, C, h)
    out = torch.baddbmm(p.b2.unsqueeze(1), hid, p.w2.transpose(1, 2))                      # (E, C, d)
    y = torch.einsum("tec,ecd->td", comb, out)                             # (T, d)
    dropped = (~keep).view(k, T).any(0) if capacity_factor is not None else None  # (T,)
    return DispatchOut(y, int(keep.sum()), p.E * C, dropped)


# ---- the references --------------------------------------------------------------------------------
def dense(p: Problem) -> DispatchOut:
    """Reference 1: one dense MLP ``d -> k*h -> d`` on all T tokens: the same FLOPs with no routing at all (a
    yardstick, not a limit: designs can beat it)."""
    return DispatchOut(expert_mlp(p.x, *p.dense_w), p.T * p.top_k, p.T * p.top_k)


def separate(p: Problem) -> DispatchOut:
    """Reference 2: E independent MLPs on tokens already sliced per expert: the expert matmuls with no dispatch,
    one call per expert (a yardstick, not a limit: one grouped call for all experts can beat it)."""
    ys = [expert_mlp(x, *w) for x, w in zip(p.sliced_x, p.sliced_w) if x.shape[0]]
    n = sum(x.shape[0] for x in p.sliced_x)
    return DispatchOut(ys, n, n)


DESIGNS = {"loop": loop, "core": CoreMoE, "padded": padded, "grouped_mm": grouped_mm, "einsum": einsum,
           "ds_cf1": 1.0, "ds_cf2": 2.0}  # classes and DeepSpeed's capacity factors: built per problem
REFERENCES = {"dense": dense, "separate": separate}


def build_designs(p: Problem, names=None) -> dict:
    """``{name: fn(p) -> DispatchOut}`` for the designs and references named (default: all), DeepSpeed built
    for ``p``."""
    table = {**DESIGNS, **REFERENCES, "fastmoe": fastmoe}
    names = list(table) if names is None else list(names)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown designs {unknown}; choose from {list(table)}")
    return {n: DeepSpeedMoE(p, table[n]) if isinstance(table[n], float)
            else table[n](p) if isinstance(table[n], type) else table[n] for n in names}
