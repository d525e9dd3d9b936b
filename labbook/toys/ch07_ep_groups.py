"""Chapter 07, section 5: expert-parallel groups inside a data-parallel world, and the lab's fastmoe layer under
``GroupedDataParallel``. (Taught in chapter 07.)

Workers ``moe_ep_groups`` (groups of ``ep_size`` ranks, the start-up broadcast checked by ``broadcast_checks``) and
``lab_fmoe_check`` (``FMoETransformerMLP(world_size=W)`` against the one-process layer holding every expert).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labbook.toys.ch07_moe import ep_copy, moe_setup
from labutils.compare import compare_models
from labutils.data_parallel import GroupedDataParallel, grad_group


def replica_gap(params, group):
    """max |p - p on the group's first rank| over ``params``, observed by an all-gather (not the broadcast under
    test); the same number on every rank (a MAX all-reduce over the world)."""
    gap = torch.zeros(())
    for p in params:
        every = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, p.detach().contiguous(), group=group)
        gap = torch.maximum(gap, max((e - every[0]).abs().max() for e in every))
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def moe_ep_groups(d, h, tokens, ep_size, replica_offset=0.0, layout=False, sync=True):
    """Worker: expert-parallel groups of ``ep_size`` ranks, each expert replicated over an expert-data-parallel
    group; the grouped gradients vs the reference's. ``replica_offset`` is added to every parameter (dense and
    expert) of the ranks outside the first group before the wrap, whose start-up broadcast must make them equal
    again (``sync=False`` skips it: a negative control). ``layout=True`` also returns the groups' ranks, how many
    gradient tensors each reduction carried (what chapter 07 draws) and the largest gap between replicas before
    and after the wrap (``"gap"``: dense over every rank, experts over their expert-data-parallel group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_ranks = [list(range(g, g + ep_size)) for g in range(0, world, ep_size)]   # hold different experts
    edp_ranks = [list(range(e, world, ep_size)) for e in range(ep_size)]          # hold the same expert
    ep_groups, edp_groups = [dist.new_group(r) for r in ep_ranks], [dist.new_group(r) for r in edp_ranks]
    e = rank % ep_size
    ref, x, target, want = moe_setup(d, h, tokens, num_experts=ep_size, e=e)
    m = ep_copy(ref, e, ep_groups[rank // ep_size])
    if replica_offset and rank >= ep_size:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(replica_offset)
    dense = [p for n, p in m.named_parameters() if not n.startswith("experts.")]

    def gaps():
        return {"dense": replica_gap(dense, dist.group.WORLD),
                "expert": replica_gap(list(m.experts.parameters()), edp_groups[e])}

    before = gaps()
    gdp = GroupedDataParallel(m, expert_dp_group=edp_groups[e], sync_params=sync)
    gap = {"before": before, "after": gaps()}
    F.mse_loss(gdp(x), target).backward()
    counts = gdp.allreduce_gradients()
    report = compare_models(m, want, "grads")
    if not layout:
        return report
    return report, {"ep": ep_ranks, "edp": edp_ranks, "counts": counts, "gap": gap,
                    "names": {n: grad_group(p) for n, p in m.named_parameters()}}


def broadcast_checks(ep_out, offset):
    """Chapter 07's checks of the start-up broadcast on ``moe_ep_groups(..., replica_offset=offset, layout=True)``'s
    results: ``[(what, ok, detail)]``. They fail when the broadcast does nothing."""
    gap = ep_out[0][1]["gap"]
    before = min(gap["before"].values())
    after = max(gap["after"].values())
    bad = [rep for rep, _ in ep_out if not rep.ok]
    return [(f"the replicas start different (gap before the wrap: dense {gap['before']['dense']:.3g}, "
             f"experts {gap['before']['expert']:.3g})", before >= 0.99 * offset, str(gap)),
            (f"the wrap's broadcast makes them equal (gap after: dense {gap['after']['dense']:.3g}, "
             f"experts {gap['after']['expert']:.3g})", after == 0.0, str(gap)),
            ("grouped gradients == reference on every rank", not bad, bad[0].table(top=2) if bad else "")]


def fmoe_block(d, h, world_size, num_expert):
    """dense -> the lab's FMoETransformerMLP (top-2) -> dense."""
    from labutils.moe import FMoETransformerMLP

    moe = FMoETransformerMLP(num_expert=num_expert, d_model=d, d_hidden=h, world_size=world_size, top_k=2)
    return nn.Sequential(nn.Linear(d, d), moe, nn.Linear(d, d))


def lab_fmoe_check(d=8, h=16, tokens=8, num_expert=2):
    """Worker: FMoETransformerMLP(world_size=W) + GroupedDataParallel vs the world_size=1 layer holding all
    ``W * num_expert`` experts: (gradient report, dp_comm tags, gradient tensors per group)."""
    from labutils.moe.expert_parallel import shard_state

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = fmoe_block(d, h, 1, world * num_expert)
    x, target = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
    F.mse_loss(ref(x), target).backward()
    m = fmoe_block(d, h, world, num_expert)
    m.load_state_dict(shard_state(ref.state_dict(), rank, num_expert))
    gdp = GroupedDataParallel(m)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    F.mse_loss(gdp(x[mine]), target[mine]).backward()
    counts = gdp.allreduce_gradients()
    tags = {n: getattr(p, "dp_comm", "dp (untagged)") for n, p in m.named_parameters()}
    want = shard_state({n: p.grad for n, p in ref.named_parameters()}, rank, num_expert)
    return compare_models(m, want, "grads"), tags, counts
