"""Chapter 07, section 5: an MoE under data parallelism, rank r owning expert r. (Taught in chapter 07.)

``Expert``, ``TinyMoE`` (top-1, expert parallel by ``keep_expert``), ``ep_copy`` and the parts of worker
``moe_checks``: plain DDP, ``GroupedDataParallel``, PyTorch's ``replicate``/``fully_shard`` with the experts left
out, each against the single-process reference's gradients, then a few SGD steps of training parity.
"""
from __future__ import annotations

from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labbook.toys.ch07_ddp import ATOL, RTOL
from labutils.compare import compare_models
from labutils.data_parallel import GroupedDataParallel, is_expert_param, mark_expert_params
from labutils.moe.dispatch import ExpertParallel, dispatch


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):  # (T, d) -> (T, d)
        return self.w2(torch.relu(self.w1(x)))


class TinyMoE(nn.Module):
    """dense -> top-1 gate -> experts -> dense. ``keep_expert(e, group)`` turns it expert parallel."""

    def __init__(self, d=8, h=16, num_experts=2):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(d, d), nn.Linear(d, num_experts), nn.Linear(d, d)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))
        self.ep_group = None

    def keep_expert(self, e, ep_group):
        """Keep only expert ``e`` (this rank's), serve the tokens of every rank in ``ep_group``."""
        self.experts, self.ep_group = nn.ModuleList([self.experts[e]]), ep_group
        self.num_expert, self.moe_group = 1, ep_group  # what the dispatcher's all-to-all transport reads
        return self

    def forward(self, x):  # (T, d) -> (T, d)
        h = self.inp(x)
        score, idx = F.softmax(self.gate(h), dim=-1).max(dim=-1)  # (T,), (T,)
        y = self.all_experts(h, idx) if self.ep_group is None else self.expert_parallel(h, idx)
        return self.out(h + score[:, None] * y)

    def all_experts(self, h, idx):
        every = torch.stack([e(h) for e in self.experts], dim=1)  # (T, E, d)
        return every[torch.arange(h.shape[0]), idx]  # (T, d)

    def expert_parallel(self, h, idx):
        """The lab's dispatcher (``labutils.moe.dispatch``) with its all-to-all transport: tokens sorted by
        expert (= by rank), sent to their expert's rank, run, sent back, put back in token order."""
        move = ExpertParallel(self, check=False)  # sizes agree by construction: one layer, called once per step
        return dispatch([h], idx[:, None], h.new_ones(h.shape[0], 1), lambda xs, counts: [move(xs[0], counts,
                        self.run_experts)], num_expert=1, world_size=dist.get_world_size(self.ep_group))[0]

    def run_experts(self, x, counts):  # this rank's one expert on the rows it received: (N_recv, d)
        return self.experts[0](x)


def ep_copy(ref, e, ep_group):
    """The expert-parallel copy of ``ref`` for the rank that owns expert ``e``, expert params tagged."""
    m = deepcopy(ref).keep_expert(e, ep_group)
    m.zero_grad(set_to_none=True)
    mark_expert_params(m.experts)
    return m


def as_rank_names(ref, e, what="grads"):
    """The reference's gradients (or parameters) as the rank owning expert ``e`` names them: its experts.0."""
    own = f"experts.{e}."
    return {k.replace(own, "experts.0."): (p.grad.clone() if what == "grads" else p.detach())
            for k, p in ref.named_parameters() if not k.startswith("experts.") or k.startswith(own)}


def moe_setup(d, h, tokens, num_experts, e):
    """The single-process reference (all experts, one backward on the global batch, the same on every rank),
    this rank's tokens and targets, and the reference's gradients for the rank owning expert ``e``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same reference model and global batch everywhere
    ref = TinyMoE(d, h, num_experts=num_experts)
    x, target = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
    F.mse_loss(ref(x), target).backward()
    mine = slice(rank * tokens, (rank + 1) * tokens)
    return ref, x[mine], target[mine], as_rank_names(ref, e)


def grads_of(model):
    """name -> gradient, without DDP's ``module.`` prefix; a sharded (DTensor) gradient gathered whole."""
    return {k.removeprefix("module."): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
            for k, p in model.named_parameters()}


def norm_rel(got, want):
    """name -> ||got - want|| / ||want|| per tensor (Frobenius norms): a relative error that near-zero entries
    cannot blow up (an elementwise max-rel divides by them)."""
    return {k: ((got[k].detach().double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
            for k, w in want.items() if k in got and got[k] is not None}


def moe_naive_ddp(ref, x, target, want):
    """Plain DDP on the expert-parallel model, with its start-up broadcast and without (init_sync=False)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    m = ep_copy(ref, rank, dist.group.WORLD)
    naive = DDP(m)  # broadcasts rank 0's parameters, experts.0 included
    out = {"naive_expert_overwritten": (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()}
    F.mse_loss(naive(x), target).backward()
    out["naive DDP"] = compare_models(grads_of(m), want, "grads")
    out["naive DDP rel"] = norm_rel(grads_of(m), want)
    m = ep_copy(ref, rank, dist.group.WORLD)
    no_sync = DDP(m, init_sync=False)  # kept referenced: a DDP collected before backward reduces nothing
    F.mse_loss(no_sync(x), target).backward()
    out["DDP init_sync=False"] = compare_models(grads_of(m), want, "grads")
    out["DDP init_sync=False rel"] = norm_rel(grads_of(m), want)
    return out


def moe_grouped(ref, x, target, want):
    """labutils' GroupedDataParallel, with DeepSpeed's expert scale (the default) and fastmoe's ("sum")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = ep_copy(ref, rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m)
    out = {"grouped_expert_overwritten": (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()}
    F.mse_loss(gdp(x), target).backward()
    out["counts"] = gdp.allreduce_gradients()
    out["grouped"] = compare_models(grads_of(m), want, "grads")
    out["grouped rel"] = norm_rel(grads_of(m), want)
    # fastmoe's scale: expert grads are the SUM over ranks = world x the reference
    m = ep_copy(ref, rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m, expert_scale="sum")
    F.mse_loss(gdp(x), target).backward()
    gdp.allreduce_gradients()
    out["sum_scale"] = compare_models({k: g / world if k.startswith("experts.") else g for k, g in grads_of(m).items()},
                                      want, "grads")
    return out


def moe_native(ref, x, target, want):
    """PyTorch's replicate() / fully_shard() for the dense parameters; expert grads divided by the world by hand."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    m = ep_copy(ref, rank, dist.group.WORLD)
    replicate(m, ignored_modules=[m.experts])
    F.mse_loss(m(x), target).backward()
    for p in m.experts.parameters():
        p.grad /= world  # DeepSpeed's scale
    out["replicate(ignored_modules=experts)"] = compare_models(grads_of(m), want, "grads")
    out["is_expert"] = {k: is_expert_param(p) for k, p in m.named_parameters()}
    # FSDP2: shard the dense parameters only, the experts stay plain local tensors
    m = ep_copy(ref, rank, dist.group.WORLD)
    fully_shard(m, ignored_params=set(m.experts.parameters()))
    F.mse_loss(m(x), target).backward()
    for p in m.experts.parameters():
        p.grad /= world
    out["fsdp_types"] = sorted({f"{k.split('.')[0]}: {type(p).__name__}" for k, p in m.named_parameters()})
    out["fully_shard(ignored_params=experts)"] = compare_models(grads_of(m), want, "grads")
    return out


def moe_train_parity(d, h, tokens, steps, lr=0.5):
    """SGD steps of the grouped expert-parallel model vs the reference, a new global batch each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyMoE(d, h, num_experts=world)
    m = GroupedDataParallel(ep_copy(ref, rank, dist.group.WORLD))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(m.parameters(), lr=lr)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    out = {"train": [], "losses": []}
    for step in range(steps):
        torch.manual_seed(1000 + step)
        xs, ts = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref = F.mse_loss(ref(xs), ts)
        loss_ref.backward()
        F.mse_loss(m(xs[mine]), ts[mine]).backward()
        m.allreduce_gradients()
        opt_ref.step()
        opt.step()
        want = as_rank_names(ref, rank, "params")
        out["train"].append(compare_models(m.module, want, "params", rtol=RTOL, atol=ATOL))
        out["losses"].append(loss_ref.item())
    return out


def moe_checks(d=8, h=16, tokens=8, steps=2):
    """Worker: rank r owns expert r; every method's gradients vs the reference's, then the training parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, x, target, want = moe_setup(d, h, tokens, num_experts=world, e=rank)
    return {**moe_naive_ddp(ref, x, target, want), **moe_grouped(ref, x, target, want),
            **moe_native(ref, x, target, want), **moe_train_parity(d, h, tokens, steps)}
