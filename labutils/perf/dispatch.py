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

Routing is shared: :func:`route` turns the same ``logits (T, E)`` into ``(idx, score)`` with DeepSpeed's
convention (softmax over all experts, top-k, scores renormalised over the k when k > 1), so DeepSpeed's layer,
fed the same logits, computes the same output wherever it drops nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..moe.functions import check_top_k, combine, count_by_gate, gather, scatter

__all__ = ["Problem", "DispatchOut", "make_problem", "route", "expert_mlp", "loop", "core", "padded",
           "grouped_mm", "einsum", "DeepSpeedMoE", "fastmoe", "dense", "separate", "DESIGNS", "REFERENCES",
           "build_designs", "fwd_bwd"]


# ---- the problem every design solves ------------------------------------------------------------
@dataclass
class Problem:
    """Inputs, routing logits and expert weights (all leaves with ``requires_grad``), plus the references' inputs."""
    x: torch.Tensor            # (T, d)
    logits: torch.Tensor       # (T, E)
    w1: torch.Tensor           # (E, h, d)
    b1: torch.Tensor           # (E, h)
    w2: torch.Tensor           # (E, d, h)
    b2: torch.Tensor           # (E, d)
    top_k: int
    grad_y: torch.Tensor       # (T, d) the output gradient every backward uses
    dense_w: list = field(default_factory=list)     # dense MLP d -> k*h -> d: W1 (k*h, d), b1, W2 (d, k*h), b2
    sliced_x: list = field(default_factory=list)    # E leaves (n_e, d): tokens already grouped by expert
    sliced_grad: list = field(default_factory=list)  # E tensors (n_e, d)
    sliced_w: list = field(default_factory=list)    # E tuples (w1_e, b1_e, w2_e, b2_e), own leaves

    T = property(lambda self: self.x.shape[0])
    d = property(lambda self: self.x.shape[1])
    h = property(lambda self: self.w1.shape[1])
    E = property(lambda self: self.w1.shape[0])

    def leaves(self) -> list:
        """Every tensor a backward may write a ``.grad`` into."""
        out = [self.x, self.logits, self.w1, self.b1, self.w2, self.b2, *self.dense_w, *self.sliced_x]
        return out + [t for ws in self.sliced_w for t in ws]

    def zero_grad(self) -> None:
        for t in self.leaves():
            t.grad = None

    def flops(self) -> float:
        """Useful FLOPs of one forward+backward: 2 linears x 3 matmuls (out, grad in, grad w) x 2*T*k*d*h."""
        return 12.0 * self.T * self.top_k * self.d * self.h


class DispatchOut(NamedTuple):
    y: object        # (T, d), or a list of per-expert outputs for the ``separate`` reference
    kept: int        # (token, choice) pairs that reached an expert (T*k when nothing is dropped)
    rows: int        # rows the experts computed, padding included
    dropped: object = None  # (T,) bool: tokens with at least one choice dropped (None: the design drops nothing)


def route(logits: torch.Tensor, top_k: int):
    """``(T, E)`` logits -> ``idx (T, k)`` int64 and ``score (T, k)``, DeepSpeed's convention (see module doc)."""
    probs = logits.float().softmax(dim=-1)                                 # (T, E)
    score, idx = probs.topk(top_k, dim=-1)                                 # (T, k)
    if top_k > 1:
        score = score / score.sum(dim=-1, keepdim=True)
    return idx, score


def make_problem(tokens: int, d_model: int, d_hidden: int, num_expert: int, top_k: int, seed: int = 0,
                 device: str | torch.device = "cpu", dtype=torch.float32, limits: bool = True) -> Problem:
    """A seeded random problem; ``limits`` also builds the dense and pre-sliced inputs of the two references."""
    check_top_k(top_k, num_expert)
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    T, d, h, E = tokens, d_model, d_hidden, num_expert
    p = Problem(x=leaf(T, d), logits=leaf(T, E).detach().float().requires_grad_(),
                w1=leaf(E, h, d, scale=d ** -0.5), b1=leaf(E, h, scale=0.1),
                w2=leaf(E, d, h, scale=h ** -0.5), b2=leaf(E, d, scale=0.1), top_k=top_k,
                grad_y=torch.randn(T, d, generator=g).to(device=device, dtype=dtype))
    if limits:
        p.dense_w = [leaf(top_k * h, d, scale=d ** -0.5), leaf(top_k * h, scale=0.1),
                     leaf(d, top_k * h, scale=h ** -0.5), leaf(d, scale=0.1)]
        _, counts = count_by_gate(route(p.logits, top_k)[0], E)
        for n in counts.tolist():
            p.sliced_x.append(leaf(n, d))
            p.sliced_grad.append(torch.randn(n, d, generator=g).to(device=device, dtype=dtype))
            p.sliced_w.append((leaf(h, d, scale=d ** -0.5), leaf(h, scale=0.1), leaf(d, h, scale=h ** -0.5),
                               leaf(d, scale=0.1)))
    return p


def expert_mlp(x, w1, b1, w2, b2):
    """One expert: ``(n, d) -> (n, h) -> GELU -> (n, d)``."""
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


# ---- the designs ------------------------------------------------------------------------------
def loop(p: Problem) -> DispatchOut:
    """Naive: for each expert find its (token, choice) pairs, run it on them, add the weighted result.

    The stacked weights are ``unbind``-ed once: indexing ``w1[e]`` inside the loop would make every expert's
    backward write a full-size ``(E, h, d)`` zero gradient, O(E^2) work (tens of times slower at E=64).
    """
    idx, score = route(p.logits, p.top_k)                                  # (T, k), (T, k)
    experts = list(zip(p.w1.unbind(0), p.b1.unbind(0), p.w2.unbind(0), p.b2.unbind(0)))
    y = torch.zeros_like(p.x)                                              # (T, d)
    for e, weights in enumerate(experts):
        tok, choice = torch.where(idx == e)                                # (n_e,), (n_e,)
        if tok.numel():
            out = expert_mlp(p.x[tok], *weights)                           # (n_e, d)
            y.index_add_(0, tok, out * score[tok, choice].unsqueeze(1).to(out.dtype))
    return DispatchOut(y, idx.numel(), idx.numel())


class _LogitsGate(nn.Module):
    """A fastmoe-style gate that routes with :func:`route` on the logits passed in (a buffer)."""

    def __init__(self, d_model, num_expert, world_size, top_k):
        super().__init__()
        self.top_k = top_k
        self.register_buffer("logits", torch.empty(0), persistent=False)

    def forward(self, x):
        return route(self.logits, self.top_k)


_CORE_LAYERS: dict = {}


def per_expert_tensors(p: Problem) -> dict:
    """The problem's fused ``(E, ...)`` expert weights as fastmoe's per-expert names (``experts.<i>.htoh4.weight``
    of shape ``(1, h, d)``): views, so gradients land in the problem's tensors. One ``split`` per tensor, so the
    backward is one concatenation of the E gradients (per-expert slicing ``t[i:i + 1]`` would give each expert's
    gradient its own zero-filled full-size buffer: E times the memory traffic of the weights)."""
    out = {"gate.logits": p.logits}
    for name, t in (("htoh4.weight", p.w1), ("htoh4.bias", p.b1), ("h4toh.weight", p.w2), ("h4toh.bias", p.b2)):
        for i, view in enumerate(t.split(1)):
            out[f"experts.{i}.{name}"] = view
    return out


def _core_layer(E: int, d: int, h: int, k: int):
    key = (E, d, h, k)
    if key not in _CORE_LAYERS:
        from ..moe.transformer import FMoETransformerMLP

        with torch.device("meta"):  # weights come from the problem through functional_call
            _CORE_LAYERS[key] = FMoETransformerMLP(num_expert=E, d_model=d, d_hidden=h, top_k=k, gate=_LogitsGate)
    return _CORE_LAYERS[key]


class CoreMoE(nn.Module):
    """The timed ``core`` design: the lab's ``labutils.moe.FMoETransformerMLP`` holding its OWN per-expert
    parameters (a copy of the problem's weights), as a user's model holds them.

    Call it with the problem: ``core(p) -> DispatchOut``; :meth:`expert_grads` stacks its per-expert gradients
    into the problem's layout for the correctness checks. (Feeding the problem's stacked tensors through
    ``functional_call`` instead, as :func:`core` does, adds a parameter swap per expert and a concatenation of
    the E gradients to every step: a cost of the harness, not of the layer, that grows with E.)
    ``kept`` and ``rows`` are counted AFTER dispatch, where the experts run (the rows ``expert_fn`` received and
    the rows it returned), not read from the routing: a core that lost rows between the gate and the experts
    would show it.
    """

    def __init__(self, p: Problem):
        super().__init__()
        from ..moe.transformer import FMoETransformerMLP

        self.layer = FMoETransformerMLP(num_expert=p.E, d_model=p.d, d_hidden=p.h, top_k=p.top_k,
                                        gate=_LogitsGate).to(device=p.x.device, dtype=p.x.dtype)
        with torch.no_grad():
            for name, t in per_expert_tensors(p).items():
                if name.startswith("experts."):
                    self.layer.get_parameter(name).copy_(t)
        self.seen: dict = {}
        _count_expert_rows(self.layer, self.seen)

    def forward(self, p: Problem) -> DispatchOut:
        self.layer.gate.logits = p.logits                                  # the shared routing
        self.seen.clear()
        y = self.layer(p.x)                                                # (T, d)
        return DispatchOut(y, self.seen.get("kept", 0), self.seen.get("rows", 0))

    def expert_grads(self) -> dict:
        """``{"w1": (E, h, d), "b1", "w2", "b2"}``: the experts' gradients in the problem's layout."""
        experts = self.layer.experts

        def stack(lin, what):
            return torch.cat([getattr(getattr(e, lin), what).grad for e in experts])

        return {"w1": stack("htoh4", "weight"), "b1": stack("htoh4", "bias"), "w2": stack("h4toh", "weight"),
                "b2": stack("h4toh", "bias")}


def _count_expert_rows(layer, seen: dict) -> None:
    """Count, where the experts run, the rows they received (``kept``: the sum of ``fwd_expert_count``, checked
    against the buffer's rows) and the rows they returned (``rows``), into ``seen``: an instance attribute
    wrapping the layer's ``expert_fn`` (``run_experts`` calls ``self.expert_fn``)."""
    inner = layer.expert_fn

    def counted(inp, fwd_expert_count):
        y = inner(inp, fwd_expert_count)                                   # (N, d)
        received = inp.shape[0] if torch.is_tensor(inp) else int(fwd_expert_count.sum())
        seen["kept"] = min(int(fwd_expert_count.sum()), received)
        seen["rows"] = y.shape[0] if torch.is_tensor(y) else received
        return y

    layer.expert_fn = counted


def core(p: Problem) -> DispatchOut:
    """The lab's FastMoE core (``labutils.moe.FMoETransformerMLP``) unchanged, fed this problem's tensors through
    ``functional_call`` (gradients land in the problem's tensors: handy for checks). The timed design is
    :class:`CoreMoE`, which holds its own parameters. ``kept`` and ``rows`` are counted where the experts run
    (see :class:`CoreMoE`)."""
    layer = _core_layer(p.E, p.d, p.h, p.top_k)
    seen: dict = {}
    if "expert_fn" in vars(layer):  # one wrapper per cached layer
        del layer.expert_fn
    _count_expert_rows(layer, seen)
    y = torch.func.functional_call(layer, per_expert_tensors(p), (p.x,))  # (T, d)
    return DispatchOut(y, seen.get("kept", 0), seen.get("rows", 0))


_FMOE_LAYERS: dict = {}


def fastmoe(p: Problem) -> DispatchOut:
    """The real fastmoe (``fmoe``, CUDA only) fed the same tensors: same parameter names as the core."""
    key = (p.E, p.d, p.h, p.top_k, p.x.device)
    if key not in _FMOE_LAYERS:
        from ..optional import require

        fmoe = require("fmoe", "the fastmoe dispatch design")
        _FMOE_LAYERS[key] = fmoe.FMoETransformerMLP(num_expert=p.E, d_model=p.d, d_hidden=p.h, top_k=p.top_k,
                                                    gate=_LogitsGate).to(p.x.device)
    y = torch.func.functional_call(_FMOE_LAYERS[key], per_expert_tensors(p), (p.x,))
    return DispatchOut(y, p.T * p.top_k, p.T * p.top_k)


def _sorted_slots(idx: torch.Tensor, E: int):
    """Sort the (token, choice) pairs by expert: ``pos``, counts, each sorted row's expert and row within it."""
    pos, counts = count_by_gate(idx, E)                                    # (N,), (E,)
    expert = idx.reshape(-1)[pos]                                          # (N,)
    slot = torch.arange(pos.numel(), device=idx.device) - (counts.cumsum(0) - counts)[expert]  # (N,)
    return pos, counts, expert, slot


def padded(p: Problem) -> DispatchOut:
    """Copy each expert's rows into an ``[E, C, d]`` buffer (C = busiest expert) and run two batched matmuls."""
    idx, score = route(p.logits, p.top_k)
    pos, counts, expert, slot = _sorted_slots(idx, p.E)
    C = int(counts.max())
    buf = p.x.new_zeros(p.E, C, p.d).index_put((expert, slot), scatter(p.x, pos, p.top_k))  # (E, C, d)
    hid = F.gelu(torch.baddbmm(p.b1.unsqueeze(1), buf, p.w1.transpose(1, 2)))              # (E, C, h)
    out = torch.baddbmm(p.b2.unsqueeze(1), hid, p.w2.transpose(1, 2))                      # (E, C, d)
    y = combine(gather(out[expert, slot], pos, idx.numel()), score)                         # (T, d)
    return DispatchOut(y, idx.numel(), p.E * C)


def grouped_mm(p: Problem) -> DispatchOut:
    """Sorted rows and one ``torch._grouped_mm`` per linear: group ``e`` is rows ``offs[e-1]:offs[e]``.

    Constraints (torch 2.13): ``mat_a`` 2-D ``(N, d)`` with ``mat_b`` 3-D ``(E, d, h)``; float32, bfloat16 or
    float16 (not float64); ``offs`` int32 cumulative group ends; empty groups are fine; its backward needs a
    contiguous incoming gradient (``y.sum().backward()`` fails); rows and weight strides 16-byte aligned, on the
    CPU too (``d`` and ``h`` multiples of 4 in float32: found by the property-based test); on CUDA sm90+.
    """
    per_row = 16 // p.x.element_size()
    if p.d % per_row or p.h % per_row:
        raise ValueError(f"grouped_mm needs 16-byte aligned rows: d_model={p.d} and d_hidden={p.h} must be "
                         f"multiples of {per_row} for {p.x.dtype}")
    idx, score = route(p.logits, p.top_k)
    pos, counts, expert, _ = _sorted_slots(idx, p.E)
    offs = counts.cumsum(0).to(torch.int32)                                # (E,)
    xs = scatter(p.x, pos, p.top_k)                                        # (N, d)
    hid = F.gelu(torch._grouped_mm(xs, p.w1.transpose(1, 2), offs=offs) + p.b1[expert])   # (N, h)
    out = torch._grouped_mm(hid, p.w2.transpose(1, 2), offs=offs) + p.b2[expert]          # (N, d)
    y = combine(gather(out, pos, idx.numel()), score)
    return DispatchOut(y, idx.numel(), idx.numel())


def einsum(p: Problem, capacity_factor: float | None = None) -> DispatchOut:
    """GShard: one-hot dispatch ``(T, E, C)`` and combine tensors, applied with einsums.

    Choices are placed choice-major (every token's first choice before any second choice), as in GShard.
    ``capacity_factor=None`` sizes C for the busiest expert (drops nothing); otherwise ``C = ceil(cf*T*k/E)``
    and choices beyond C are dropped.
    """
    idx, score = route(p.logits, p.top_k)
    T, k = idx.shape
    onehot = F.one_hot(idx.t().reshape(-1), p.E)                           # (k*T, E) choice-major
    loc = (onehot.cumsum(0) - 1).gather(1, idx.t().reshape(-1, 1)).squeeze(1)  # (k*T,) row within its expert
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


class _DeepSpeedLogitsGate(nn.Module):
    """DeepSpeed's own gating functions (top1/top2/topkgating) applied to the problem's logits.

    Replaces ``TopKGate`` only to skip its ``x @ wg`` (the logits are given, as for every design); the
    capacity, dropping, normalisation and sparse routes are DeepSpeed's code. Records kept choices and C.
    """

    def __init__(self, gate):
        super().__init__()
        self.k, self.capacity_factor, self.min_capacity = gate.k, gate.capacity_factor, gate.min_capacity
        self.ep_group, self.logits, self.kept, self.capacity, self.dropped = None, None, 0, 0, None

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        from deepspeed.moe import sharded_moe as sm

        logits, cf = self.logits.float(), self.capacity_factor
        if self.k == 1:
            out = sm.top1gating(logits, cf, self.min_capacity, used_token, None, True, False, self.ep_group,
                                sparse_routes, use_tutel)
        elif self.k == 2:
            out = sm.top2gating(logits, cf, self.min_capacity, True, self.ep_group, False, sparse_routes)
        else:
            out = sm.topkgating(logits, self.k, cf, self.min_capacity, True, self.ep_group, sparse_routes=sparse_routes)
        if sparse_routes:  # (l_aux, C, E, indices (k, T) with -1 = dropped, locations, gates, counts)
            self.capacity, self.kept = int(out[1]), int((out[3] >= 0).sum())
            self.dropped = (out[3] < 0).any(0)                             # (T,) bool
        else:  # dense: (l_aux, combine (T, E, C), dispatch mask (T, E, C), counts)
            mask = out[2]
            self.capacity, self.kept = int(mask.shape[-1]), int(mask.sum())
            self.dropped = mask.flatten(1).sum(1) < self.k                 # (T,) bool
        return out


class DeepSpeedMoE(nn.Module):
    """``deepspeed.moe.layer.MoE`` (ep_size 1) holding a copy of the problem's expert weights.

    Call it with the problem: ``ds(p) -> DispatchOut``. Its expert parameters are its own (DeepSpeed keeps one
    ``nn.Module`` per expert); :meth:`expert_grads` stacks their gradients into the problem's layout.
    """

    def __init__(self, p: Problem, capacity_factor: float, min_capacity: int = 4):
        super().__init__()
        _import_deepspeed()
        from deepspeed.moe.layer import MoE

        expert = nn.Sequential(nn.Linear(p.d, p.h), nn.GELU(), nn.Linear(p.h, p.d))
        self.moe = MoE(p.d, expert, num_experts=p.E, k=p.top_k, capacity_factor=capacity_factor,
                       eval_capacity_factor=capacity_factor, min_capacity=min_capacity, use_rts=False,
                       top2_2nd_expert_sampling=False).to(device=p.x.device, dtype=p.x.dtype)
        self.gate = _DeepSpeedLogitsGate(self.moe.deepspeed_moe.gate)
        self.moe.deepspeed_moe.gate = self.gate
        with torch.no_grad():
            for e, mlp in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for lin, w, b in ((mlp[0], p.w1, p.b1), (mlp[2], p.w2, p.b2)):
                    lin.weight.copy_(w[e])
                    lin.bias.copy_(b[e])

    def forward(self, p: Problem) -> DispatchOut:
        self.gate.logits = p.logits
        y, _, _ = self.moe(p.x)                                            # (T, d)
        return DispatchOut(y, self.gate.kept, p.E * self.gate.capacity, self.gate.dropped)

    def expert_grads(self) -> dict:
        """``{"w1": (E, h, d), "b1", "w2", "b2"}``: the experts' gradients in the problem's layout."""
        experts = self.moe.deepspeed_moe.experts.deepspeed_experts

        def stack(i, what):
            return torch.stack([getattr(m[i], what).grad for m in experts])

        return {"w1": stack(0, "weight"), "b1": stack(0, "bias"), "w2": stack(2, "weight"), "b2": stack(2, "bias")}


def _import_deepspeed():
    try:
        from ..ds.runtime import import_deepspeed  # quiet logs, CPU accelerator chosen explicitly
    except ImportError:  # pragma: no cover - labutils copied without ds.py
        from ..optional import require

        return require("deepspeed", "the DeepSpeed dispatch design")
    return import_deepspeed()


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


def fwd_bwd(fn, p: Problem) -> DispatchOut:
    """One training step of a design: forward, then backward of ``p.grad_y`` (grads land in ``.grad``)."""
    p.zero_grad()
    if isinstance(fn, nn.Module):
        fn.zero_grad(set_to_none=True)
    out = fn(p)
    if isinstance(out.y, list):
        grads = [g for g in p.sliced_grad if g.shape[0]]
        torch.autograd.backward(out.y, grads)
    else:
        out.y.backward(p.grad_y)
    return out
