"""Whole MoE layers run as dispatch designs on the problem's weights and routing. (Taught in chapter 08.)

* ``core``: the lab's FastMoE core, ``labutils.moe.FMoETransformerMLP``, unchanged: :class:`CoreMoE` (the timed
  design, holding its own per-expert parameters as a user's model does) and :func:`core` (the problem's tensors
  fed through ``functional_call``: gradients land in the problem, handy for checks).
* ``ds_cf1`` / ``ds_cf2``: DeepSpeed's ``MoE`` layer (:class:`DeepSpeedMoE`), fed the same logits.
* ``fastmoe``: the real fastmoe's ``FMoETransformerMLP`` (CUDA only, when importable).

Each layer's gate is replaced by one that routes the problem's logits with :func:`~labbook.perf.problem.route`,
so every design sees the same routing; the rest is the layer's own code.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .problem import DispatchOut, Problem, route

__all__ = ["CoreMoE", "core", "per_expert_tensors", "DeepSpeedMoE", "fastmoe"]


# ---- the lab's core and real fastmoe: fastmoe's per-expert parameter names ----------------------------------
class _LogitsGate(nn.Module):
    """A fastmoe-style gate that routes with :func:`route` on the logits passed in (a buffer)."""

    logits: torch.Tensor  # (T, E), set per call (a buffer, so ``functional_call`` can pass it)

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
        from labutils.moe.transformer import FMoETransformerMLP

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
        from labutils.moe.transformer import FMoETransformerMLP

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
        experts = cast(nn.ModuleList, self.layer.experts)

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
        from labutils.optional import require

        fmoe = require("fmoe", "the fastmoe dispatch design")
        _FMOE_LAYERS[key] = fmoe.FMoETransformerMLP(num_expert=p.E, d_model=p.d, d_hidden=p.h, top_k=p.top_k,
                                                    gate=_LogitsGate).to(p.x.device)
    y = torch.func.functional_call(_FMOE_LAYERS[key], per_expert_tensors(p), (p.x,))
    return DispatchOut(y, p.T * p.top_k, p.T * p.top_k)


# ---- DeepSpeed's MoE layer ----------------------------------------------------------------------------------
class _DeepSpeedLogitsGate(nn.Module):
    """DeepSpeed's own gating functions (top1/top2/topkgating) applied to the problem's logits.

    Replaces ``TopKGate`` only to skip its ``x @ wg`` (the logits are given, as for every design); the
    capacity, dropping, normalisation and sparse routes are DeepSpeed's code. Records kept choices and C.
    """

    def __init__(self, gate):
        super().__init__()
        self.k, self.capacity_factor, self.min_capacity = gate.k, gate.capacity_factor, gate.min_capacity
        self.ep_group, self.kept, self.capacity, self.dropped = None, 0, 0, None
        self.logits = torch.empty(0)                                       # (T, E), set per call

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        from deepspeed.moe import sharded_moe as sm

        logits, cf = self.logits.float(), self.capacity_factor
        if self.k == 1:
            out = sm.top1gating(logits, cf, self.min_capacity, used_token,  # pyright: ignore[reportArgumentType]
                                None, True, False, self.ep_group, sparse_routes, use_tutel)
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
            for e, linears in enumerate(self._linears()):
                for lin, w, b in zip(linears, (p.w1, p.w2), (p.b1, p.b2)):
                    lin.weight.copy_(w[e])
                    lin.bias.copy_(b[e])

    def _linears(self) -> list[tuple[nn.Linear, nn.Linear]]:
        """Each DeepSpeed expert's two ``nn.Linear`` (its copies of the ``Sequential(Linear, GELU, Linear)``)."""
        experts = cast(nn.ModuleList, self.moe.deepspeed_moe.experts.deepspeed_experts)
        return [(cast(nn.Linear, m.get_submodule("0")), cast(nn.Linear, m.get_submodule("2"))) for m in experts]

    def forward(self, p: Problem) -> DispatchOut:
        self.gate.logits = p.logits
        y, _, _ = self.moe(p.x)                                            # (T, d)
        return DispatchOut(y, self.gate.kept, p.E * self.gate.capacity, self.gate.dropped)

    def expert_grads(self) -> dict:
        """``{"w1": (E, h, d), "b1", "w2", "b2"}``: the experts' gradients in the problem's layout."""
        linears = self._linears()

        def stack(i, what):
            return torch.stack([getattr(pair[i], what).grad for pair in linears])

        return {"w1": stack(0, "weight"), "b1": stack(0, "bias"), "w2": stack(1, "weight"), "b2": stack(1, "bias")}


def _import_deepspeed():
    try:
        from labutils.ds.runtime import import_deepspeed  # quiet logs, CPU accelerator chosen explicitly
    except ImportError:  # pragma: no cover - labutils copied without ds.py
        from labutils.optional import require

        return require("deepspeed", "the DeepSpeed dispatch design")
    return import_deepspeed()
