"""Three ways to move tokens to experts on other ranks, checked against one process and measured on the wire.
(Taught in chapter 06, section "Three ways to move tokens"; recorded by ``benchmarks/token_exchange.py``.)

=============  ==============================================================================================
``fastmoe``    the lab's FastMoE-style layer: each rank holds its own tokens; an all-to-all of exactly the routed
               rows (no padding), the experts, an all-to-all back (``labutils.moe.expert_parallel``)
``ds drop``    DeepSpeed 0.19.8 ``MoE(ep_size=W, drop_tokens=True)``: the ``(E, C, d)`` capacity buffer, padded to
               ``C`` slots per expert whatever the routing, rows over capacity dropped
``ds dropless``the same with ``drop_tokens=False``: ``C`` is the largest per-expert count, all-reduced with MAX over
               the expert-parallel group, so the buffer follows the routing and nothing is dropped
``all-reduce`` Hugging Face transformers' expert parallelism: the hidden states are replicated on every rank of the
               group; each rank runs its own experts on the tokens routed to them and the partial outputs are
               summed with an all-reduce (backward: identity for the experts, the router's partial gradients summed)
=============  ==============================================================================================

Every design is run on the same global batch (``tokens`` rows per rank; the all-reduce design holds all of them on
every rank) with the same weights, and :func:`run_design` returns, on every rank: the largest output and gradient
difference from one process holding every expert, the bytes this rank put on the wire per training step (counted by
the kernel with :mod:`labutils.wire`, so padding and every collective are seen), and the step time.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labutils.moe import FMoETransformerMLP
from labutils.moe.expert_parallel import shard_state
from labutils.wire import count_wire

DESIGNS = ("fastmoe", "ds drop", "ds dropless", "all-reduce")


class _SumForwardIdentityBackward(torch.autograd.Function):
    """Megatron's "g" operator: all-reduce (sum) in the forward, identity in the backward (every rank holds the
    same loss on the same replicated output, so each rank's gradient is already the whole one)."""

    @staticmethod
    def forward(ctx, y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class _LocalExperts(nn.Module):
    """The router over every global expert, keeping only the choices of this rank's experts (others -> -1,
    dropped), renumbered locally: a gate for an ``FMoE`` that holds ``num_local`` experts."""

    def __init__(self, gate: nn.Module, first: int, num_local: int):
        super().__init__()
        self.gate: Any = gate  # a labutils.moe gate: (idx, score) = gate(x), get_loss, has_loss
        self.first, self.num_local = first, num_local

    def forward(self, x):
        idx, score = self.gate(x)                                           # (N, k) global ids, (N, k)
        local = (idx >= self.first) & (idx < self.first + self.num_local)
        return torch.where(local, idx - self.first, torch.full_like(idx, -1)), score * local

    def get_loss(self, clear=True):
        return self.gate.get_loss(clear)

    @property
    def has_loss(self):
        return self.gate.has_loss


def _full_layer(experts: int, d: int, h: int, k: int, seed: int) -> FMoETransformerMLP:
    torch.manual_seed(seed)                                                 # the same on every rank
    full = FMoETransformerMLP(experts, d, h, top_k=k)
    with torch.no_grad():
        for p in full.parameters():                                         # order-one weights: gradients of
            p.normal_(0, p.shape[-1] ** -0.5)                               # order one, a real 1e-5 test
    return full


def _batch(seed: int, world: int, tokens: int, d: int) -> tuple:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(world * tokens, d, generator=g), torch.randn(world * tokens, d, generator=g)


def _err(got: dict, want: dict) -> float:
    """Largest |difference| over tensors, relative to each reference tensor's largest entry."""
    return max(float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), 1e-12) for n in want)


def _lab_layer(design, full, experts, d, h, k, rank, world):
    ne = experts // world
    if design == "fastmoe":
        part = FMoETransformerMLP(ne, d, h, top_k=k, world_size=world)
        part.load_state_dict(shard_state(full.state_dict(), rank, ne))
        return part
    part = FMoETransformerMLP(ne, d, h, top_k=k)                             # all-reduce: my experts only ...
    mine = shard_state(full.state_dict(), rank, ne)
    experts = part.experts
    assert experts is not None  # FMoETransformerMLP always builds its experts
    experts.load_state_dict({n[len("experts."):]: v for n, v in mine.items() if n.startswith("experts.")})
    part.add_module("gate", _LocalExperts(copy.deepcopy(full.gate), rank * ne, ne))  # ... behind the whole router
    return part


def all_reduce_together(grads: list) -> None:
    """Sum ``grads`` over the ranks in ONE all_reduce (flattened, as DDP's buckets do): every design reduces its
    replicated parameters' gradients with one collective per step, however many tensors its router has (the lab's
    gate has a weight and a bias, DeepSpeed's a weight only)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def _reference_lab(full, x_all, w_all):
    x = x_all.clone().requires_grad_()
    y = full(x)
    (y * w_all).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in full.named_parameters()}


def _step_lab(design, part, x, w, fault=None):
    """One training step's forward, backward and router-gradient reduction; returns the output and x's grad.
    ``fault="router not summed"`` skips the router's reduction (the negative control of the parity check)."""
    x = x.clone().requires_grad_()
    y = part(x)
    if design == "all-reduce":
        y = _SumForwardIdentityBackward.apply(y)
    (y * w).sum().backward()
    grad_x = x.grad
    if fault != "router not summed":                                        # the replicated router: its gradient
        all_reduce_together([p.grad for n, p in part.named_parameters()    # summed over the ranks (each saw its
                             if n.startswith("gate.")])                     # tokens, or its experts' share)
    if design == "all-reduce":
        dist.all_reduce(grad_x)                                             # replicated input: partials summed
    return y.detach(), grad_x


def _setup_lab(design, experts, d, h, k, tokens, seed, fault=None):
    """The layer of one lab design on this rank: ``(errors against one process, step, facts)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full_layer(experts, d, h, k, seed)
    x_all, w_all = _batch(seed, world, tokens, d)
    y_ref, gx_ref, g_ref = _reference_lab(full, x_all, w_all)
    part = _lab_layer(design, full, experts, d, h, k, rank, world)
    mine = slice(0, None) if design == "all-reduce" else slice(rank * tokens, (rank + 1) * tokens)
    x, w = x_all[mine], w_all[mine]

    def step():
        part.zero_grad(set_to_none=True)
        return _step_lab(design, part, x, w, fault)

    y, gx = step()
    ne = experts // world
    want = shard_state(g_ref, rank, ne)
    got = {n: p.grad for n, p in part.named_parameters()}
    got = {n.replace("gate.gate.gate.", "gate.gate."): g for n, g in got.items()}
    errors = {"output": _err({"y": y}, {"y": y_ref[mine]}), "input grad": _err({"x": gx}, {"x": gx_ref[mine]}),
              "param grads": _err(got, want)}
    with torch.no_grad():                                                   # the routing of this rank's tokens
        idx = full.gate(x_all[rank * tokens:(rank + 1) * tokens])[0]
    routed = torch.bincount(idx[idx >= 0].flatten(), minlength=experts).tolist()
    return errors, step, {"tokens_without_output": 0, "choices_dropped": 0, "routed": routed}


def _setup_ds(design, experts, d, h, k, tokens, seed, fault=None):
    """The DeepSpeed layer of one design on this rank: ``(errors against one process, step, facts)``."""
    from labbook.toys.ch02_deepspeed import ep_layers
    from labutils.moe.capacity import deepspeed_capacity

    rank = dist.get_rank()
    full, sharded = ep_layers(d, experts, k, seed, drop_tokens=(design == "ds drop"))
    from labutils.ds.runtime import shard_for_rank

    g = torch.Generator().manual_seed(seed + 1 + rank)                      # every rank its own tokens
    x, w = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)

    seen = {}

    def run(model, reduce_all):
        model.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        y, _, seen["counts"] = model(xr)                                     # counts: (E,) routed, before drops
        (y * w).sum().backward()
        if not (fault == "router not summed" and not reduce_all):           # router over ranks; ep_size=1's
            all_reduce_together([p.grad for n, p in model.named_parameters()  # experts too (each saw its tokens)
                                 if p.grad is not None and (reduce_all or "deepspeed_experts" not in n)])
        return y.detach(), xr.grad

    y_ref, gx_ref = run(full, True)
    g_ref = shard_for_rank({n: p.grad for n, p in full.named_parameters() if p.grad is not None}, sharded, rank)
    y, gx = run(sharded, False)
    got = {n: p.grad for n, p in sharded.named_parameters() if p.grad is not None}
    errors = {"output": _err({"y": y}, {"y": y_ref}), "input grad": _err({"x": gx}, {"x": gx_ref}),
              "param grads": _err(got, g_ref)}
    kept = int((y.abs().sum(1) > 0).sum())                                  # tokens with any expert output
    cap = deepspeed_capacity(tokens, experts, 1.0, k=k, min_capacity=0) if design == "ds drop" else tokens * k
    dropped = int((seen["counts"].long() - cap).clamp_min(0).sum())          # choices over capacity
    return errors, lambda: run(sharded, False), {"tokens_without_output": tokens - kept, "choices_dropped": dropped,
                                                 "routed": seen["counts"].long().tolist()}


def _setup(design, experts, d, h, k, tokens, seed, fault=None):
    world = dist.get_world_size()
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if experts % world or experts // world < k:
        raise ValueError(f"experts={experts} must be a multiple of the world size {world} with at least k={k} "
                         "experts per rank")
    setup = _setup_lab if design in ("fastmoe", "all-reduce") else _setup_ds
    return setup(design, experts, d, h, k, tokens, seed, fault)


def _measure(step, steps: int) -> dict:
    """Bytes this rank sends and seconds per step (after one warm-up), each step started together (barrier)."""
    step()
    sent, seconds = [], []
    for _ in range(steps):
        dist.barrier()
        with count_wire() as wire:
            t0 = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t0)                        # not the counter's settling wait
        sent.append(wire.sent)
    return {"sent": sent, "seconds": seconds}


FAULTS = (None, "router not summed")


def run_design(design: str, *, experts: int, d: int, h: int, k: int = 2, tokens: int = 64, steps: int = 10,
               seed: int = 0, fault: str | None = None) -> dict:
    """On every rank of a gloo launch: parity with one process and the per-step wire bytes and times of one
    design. Returns ``{"errors": {"output", "input grad", "param grads"}, "sent": [...], "seconds": [...],
    "sent_median", "seconds_median", "tokens_without_output", "choices_dropped", "routed"}`` (expert choices over the
    capacity, and tokens that lost every choice: the dropping design's cost in quality, not in bytes; ``routed``: this
    rank's tokens' choices per global expert, before any drop, from which a reader can work out the payload)."""
    errors, step, facts = _setup(design, experts, d, h, k, tokens, seed, fault)
    measured = {**_measure(step, steps), **facts}
    return {"errors": errors, **measured, "sent_median": statistics.median(measured["sent"]),
            "seconds_median": statistics.median(measured["seconds"])}


def time_paired(designs: tuple = ("fastmoe", "ds drop"), *, experts: int, d: int, h: int, k: int = 2,
                tokens: int = 64, rounds: int = 8, steps: int = 5, seed: int = 0) -> dict:
    """On every rank of a gloo launch: the step times of two designs, interleaved so that each round's pair of
    blocks shares the machine's conditions (the load of other processes, the cores' clocks). Round ``i`` runs one
    untimed step and ``steps`` timed steps (each started together, at a barrier) of each design, the first design
    first in even rounds, second in odd ones. Returns ``{design: [[seconds of each step] for each round],
    "errors": {design: its parity errors}}``; the bench takes the slowest rank per step and each block's median: a
    pair of medians per round (``benchmarks/token_exchange.py``)."""
    if len(designs) != 2 or len(set(designs)) != 2:
        raise ValueError(f"time_paired compares two different designs, got {designs!r}")
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1, got rounds={rounds!r}, steps={steps!r}")
    setups = {design: _setup(design, experts, d, h, k, tokens, seed) for design in designs}
    out: dict = {design: [] for design in designs}
    for i in range(rounds):
        for design in (designs if i % 2 == 0 else designs[::-1]):
            step = setups[design][1]
            step()                                                          # untimed: the other design ran last
            seconds = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - t0)
            out[design].append(seconds)
    out["errors"] = {design: setups[design][0] for design in designs}
    return out
