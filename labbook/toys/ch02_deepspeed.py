"""Chapter 02: DeepSpeed's MoE layer on gloo workers (DeepSpeed is imported inside the functions only). (Taught in
chapter 02.)

``expert`` (the expert every layer copies), ``distinct_experts``; workers ``ep_parity`` (``ep_size=W`` against
``ep_size=1``) and ``capacity_pitfall`` (ranks whose capacities differ, with and without the capacity guard).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def expert(d):
    """The expert every MoE layer in chapter 02 copies: a 2-layer MLP."""
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


def distinct_experts(moe, seed=0):
    """Re-initialise every expert differently (DeepSpeed starts them identical), so routing matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return moe


def ep_layers(d, num_experts, k, seed=0, **moe_kwargs):
    """This rank's ``ep_size=1`` layer (all experts, made distinct) and the ``ep_size=W`` layer holding its share.
    ``moe_kwargs`` override DeepSpeed ``MoE`` arguments (``capacity_factor``, ``drop_tokens``, ...)."""
    from labutils.ds.runtime import init_deepspeed, shard_for_rank
    from labutils.nbtools import quiet

    init_deepspeed()  # adopts the gloo group launch created
    from deepspeed.moe.layer import MoE

    def build(ep_size):
        torch.manual_seed(seed)
        kwargs = dict(capacity_factor=1.0, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
        return MoE(d, expert(d), num_experts=num_experts, ep_size=ep_size, k=k, **{**kwargs, **moe_kwargs})

    full, sharded = distinct_experts(build(1), seed), build(dist.get_world_size())
    with quiet():
        sharded.set_deepspeed_parallelism()  # creates the expert-parallel group "ep_size_2"
    sharded.load_state_dict(shard_for_rank(full.state_dict(), sharded, dist.get_rank()))
    return full, sharded


def ep_parity(d, num_experts, k, tokens, seed=0):
    """Worker: both layers on this rank's tokens: their outputs, and their gradients as ``ep_size=W`` names them."""
    from labutils.ds.runtime import shard_for_rank

    rank = dist.get_rank()
    full, sharded = ep_layers(d, num_experts, k, seed)
    torch.manual_seed(seed + 1 + rank)  # every rank has its own tokens
    x, target = torch.randn(tokens, d), torch.randn(tokens, d)  # (S, d)
    outs = {}
    for name, model in (("ep1", full), ("ep2", sharded)):
        y, l_aux, _ = model(x)
        (((y - target) ** 2).mean() + 0.01 * l_aux).backward()
        outs[name] = y.detach()
    grads1 = {n: p.grad.clone() for n, p in full.named_parameters() if p.grad is not None}
    for n, g in grads1.items():
        if "deepspeed_experts" in n:
            dist.all_reduce(g)  # ep_size=1: each rank saw only its tokens
    return {"out": outs, "grads_ep1": shard_for_rank(grads1, sharded, rank),
            "grads_ep2": {n: p.grad for n, p in sharded.named_parameters()}}


def capacity_pitfall(d, num_experts, guard, fix):
    """Worker: ranks whose capacities differ (``drop_tokens=False``), with or without the guard and the expert
    group (``fix``): "CapacityMismatchError: ..." or "ran: ..."."""
    from labutils.ds.runtime import CapacityMismatchError, init_deepspeed, install_capacity_guard
    from labutils.nbtools import quiet

    init_deepspeed()
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(d, expert(d), num_experts=num_experts, ep_size=2, k=1, drop_tokens=False, use_rts=False)
    if fix:
        with quiet():
            moe.set_deepspeed_parallelism()
    if guard:
        install_capacity_guard(moe)
    torch.manual_seed(1)  # rank 1's tokens all look alike: one expert gets all of them
    x = torch.randn(16, d) if dist.get_rank() == 0 else torch.randn(1, d) + 0.01 * torch.randn(16, d)  # (S, d)
    try:
        _, _, counts = moe(x)
    except CapacityMismatchError as exc:
        return f"CapacityMismatchError: {exc}"
    return f"ran: local max load {int(counts.max())}"
