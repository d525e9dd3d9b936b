"""Expert-parallel gradient bugs that loss curves do not show, and the check that catches each. (Taught in
chapter 06, section "Bugs that training curves miss".)

Three bug classes shipped in widely used systems in 2025-26 (pytorch issue 160285, transformers issue 48687 and
PR 48205, Megatron-LM PR 5956). Each is a wrong gradient *synchronisation*, so the forward pass, and the loss, are
exactly right at the step the bug first acts; only the update is off. Here each is one line in
:func:`sync_grads`, switched on by name (:data:`BUGS`):

====================  =========================================================================================
``correct``           :func:`labutils.data_parallel.allreduce_grouped_grads`: dense and router gradients averaged
                      over every rank; expert gradients summed over the replicas of the same experts and divided
                      by the world size (each rank's loss is the mean over its own tokens)
``experts x EP``      expert gradients not divided: each expert receives gradients from every rank's tokens
                      through the all-to-all's backward, so they come out ``world`` times too large
``router unreduced``  the router's gradient is left local: each rank steps its router with its own tokens only,
                      and the replicas of the router drift apart
``router twice``      the router's gradient reduced twice (an averaging all-reduce, then a summing one on top)
``DP mixes experts``  a data-parallel all-reduce that treats expert weights as replicated: at DP x EP = 2 x 2 it
                      averages the gradients of *different* experts held by ranks of one expert-parallel group
====================  =========================================================================================

:func:`grad_check` is the book's W-workers == 1-process check (chapter 06), per parameter group: it names the
group that differs and the smallest tolerance that would have hidden it. :func:`train_curves` trains the same
model with each variant and returns the global loss per step, to show how little the curves differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labutils.agreement import require_process_group
from labutils.data_parallel import allreduce_grouped_grads
from labutils.moe import FMoETransformerMLP
from labutils.moe.expert_parallel import shard_state

BUGS = ("correct", "experts x EP", "router unreduced", "router twice", "DP mixes experts")
GROUPS = ("dense", "router", "experts")


def _check_bug(bug: str) -> None:
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")


class EPNet(nn.Module):
    """A dense input layer, an MoE feed-forward (router + experts) and a linear head: ``(T, d) -> (T, 1)``."""

    def __init__(self, d: int, h: int, num_expert: int, world_size: int = 1, moe_group=None, top_k: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.moe = FMoETransformerMLP(num_expert, d, h, top_k=top_k, world_size=world_size, moe_group=moe_group)
        self.head = nn.Linear(d, 1)

    def forward(self, x):  # (T, d) -> (T, 1)
        return self.head(self.moe(torch.tanh(self.inp(x))))


def param_group(name: str) -> str:
    """``dense``, ``router`` or ``experts``: the group a parameter of :class:`EPNet` belongs to."""
    if name.startswith("moe.gate."):
        return "router"
    return "experts" if name.startswith("moe.experts.") else "dense"


def layout(world: int | None, ep: int) -> dict:
    """Groups for DP x EP: ranks ``[g*ep, (g+1)*ep)`` form expert-parallel group g (they hold different experts);
    ranks with the same ``rank % ep`` hold replicas of the same experts (their expert-data-parallel group).
    Every rank must call this (``dist.new_group`` is collective), in the same order. ``world`` must be the launch's
    size (None: it is)."""
    require_process_group(what="ep_bugs.grad_check / train_curves / layout")
    if world is None:
        world = dist.get_world_size()
    if world != dist.get_world_size():
        raise ValueError(f"world={world!r}, but this launch has {dist.get_world_size()} ranks: pass "
                         f"world={dist.get_world_size()} or leave world out (it defaults to the launch's size)")
    if world % ep:
        raise ValueError(f"ep={ep} must divide the world size {world}")
    rank = dist.get_rank()
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world // ep)]
    rep_groups = [dist.new_group(list(range(r, world, ep))) for r in range(ep)]
    return {"ep_group": ep_groups[rank // ep], "expert_dp_group": rep_groups[rank % ep] if world > ep else None,
            "ep_rank": rank % ep, "dp_rank": rank // ep}


def _data(seed: int, step: int, rank: int, tokens: int, d: int, teacher: torch.Tensor) -> tuple:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(tokens, d, generator=g)                              # (T, d)
    return x, torch.sin(x @ teacher)                                      # (T, d), (T, 1)


def _teacher(seed: int, d: int) -> torch.Tensor:
    return torch.randn(d, 1, generator=torch.Generator().manual_seed(seed + 17)) * d ** -0.5


def _reference(d, h, ne_total, seed) -> EPNet:
    torch.manual_seed(seed)                                               # the same weights on every rank
    ref = EPNet(d, h, ne_total)
    with torch.no_grad():                                                 # order-one weights: gradients that a
        for p in ref.moe.parameters():                                    # 1e-5 tolerance can really test
            p.normal_(0, p.shape[-1] ** -0.5)
    return ref


def _shard(ref: EPNet, d, h, ne, ep, groups) -> EPNet:
    net = EPNet(d, h, ne, world_size=ep, moe_group=groups["ep_group"])
    net.load_state_dict(_shard_like(ref.state_dict(), groups["ep_rank"], ne))
    return net


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        raise RuntimeError("sync_grads: a parameter has no gradient; call backward() first")
    return p.grad


def sync_grads(net: EPNet, bug: str, groups: dict) -> None:
    """Synchronise gradients after ``backward()``: the correct recipe, or the named bug (see the module doc)."""
    _check_bug(bug)
    world = dist.get_world_size()
    router = [_grad(p) for n, p in net.named_parameters() if param_group(n) == "router"]
    if bug == "DP mixes experts":                                          # everything averaged over every rank
        for p in net.parameters():
            dist.all_reduce(_grad(p))
            _grad(p).div_(world)
        return
    saved = [g.clone() for g in router]
    allreduce_grouped_grads(net, expert_dp_group=groups["expert_dp_group"],
                            expert_scale="sum" if bug == "experts x EP" else "mean")
    if bug == "router unreduced":                                          # undo: keep the local gradient
        for g, s in zip(router, saved):
            g.copy_(s)
    elif bug == "router twice":                                            # a second, summing reduction
        for g in router:
            dist.all_reduce(g)
    if bug == "experts x EP" and groups["expert_dp_group"] is not None:    # "sum" skipped the divide; replicas
        dp = dist.get_world_size(groups["expert_dp_group"])                # summed: keep only the EP factor
        for n, p in net.named_parameters():
            if param_group(n) == "experts":
                _grad(p).div_(dp)


def _backward(net, x, y, bug, groups) -> float:
    """One backward of my tokens' mean loss and the gradient sync; returns the GLOBAL mean loss (every rank's)."""
    net.zero_grad(set_to_none=False)
    loss = (net(x) - y).pow(2).mean()                                      # my tokens' mean
    loss.backward()
    sync_grads(net, bug, groups)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _shard_like(tensors: dict, ep_rank: int, ne: int) -> dict:
    """A reference EPNet's per-parameter tensors (grads, updates) cut to what rank ``ep_rank`` holds."""
    moe = shard_state({k[4:]: v for k, v in tensors.items() if k.startswith("moe.")}, ep_rank, ne)
    return {**{k: v for k, v in tensors.items() if not k.startswith("moe.")}, **{f"moe.{k}": v for k, v in moe.items()}}


def _compare(got: dict, want: dict, rtol: float, atol: float) -> dict:
    """Per group: largest error relative to the reference's largest entry, and whether all is within tolerance."""
    out = {}
    for group in GROUPS:
        names = [n for n in got if param_group(n) == group]
        scale = max(float(want[n].abs().max()) for n in names)
        err = max(float((got[n] - want[n]).abs().max()) for n in names)
        out[group] = {"rel": err / scale,
                      "ok": all(bool(torch.allclose(got[n], want[n], rtol=rtol, atol=atol)) for n in names)}
    out["failed"] = [g for g in GROUPS if not out[g]["ok"]]
    return out


def _adam_update(net: nn.Module, lr: float = 1e-3) -> dict:
    """The change one Adam step makes to every parameter (gradients already in place)."""
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.optim.Adam(net.parameters(), lr=lr).step()
    return {n: p.detach() - before[n] for n, p in net.named_parameters()}


def grad_check(bug: str, *, world: int | None = None, ep: int = 2, d: int = 8, h: int = 16, ne: int = 2,
               tokens: int = 12, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-6) -> dict:
    """On every rank of a launch: one step's synchronised gradients vs one process with every expert on the
    global batch (the book's W-workers == 1-process check). Returns ``{"grads": report, "adam": report}``: per
    parameter group (dense, router, experts) the largest error relative to the reference's largest entry (``rel``:
    the smallest relative tolerance that would have hidden the bug) and ``ok``, and the groups that ``failed``.
    ``"adam"`` compares the update one Adam step makes instead of the gradients: the weaker check that many
    parity tests do, and that a gradient scale bug passes. ``world``: the launch's size (None, the default: it is)."""
    _check_bug(bug)
    groups = layout(world, ep)
    world = dist.get_world_size()
    rank = dist.get_rank()
    teacher = _teacher(seed, d)
    ref = _reference(d, h, ne * ep, seed)
    xs = [_data(seed, 0, r, tokens, d, teacher) for r in range(world)]
    net = _shard(ref, d, h, ne, ep, groups)
    ref.zero_grad()
    (ref(torch.cat([x for x, _ in xs])) - torch.cat([y for _, y in xs])).pow(2).mean().backward()  # global mean
    x_mine, y_mine = xs[rank]
    _backward(net, x_mine, y_mine, bug, groups)
    grads = _compare({n: p.grad for n, p in net.named_parameters()},
                     _shard_like({n: p.grad for n, p in ref.named_parameters()}, groups["ep_rank"], ne), rtol, atol)
    adam = _compare(_adam_update(net), _shard_like(_adam_update(ref), groups["ep_rank"], ne), 1e-4, 1e-7)
    return {"grads": grads, "adam": adam}


def train_curves(bug: str, *, steps: int, world: int | None = None, ep: int = 2, d: int = 8, h: int = 16,
                 ne: int = 2, tokens: int = 12, seed: int = 0, lr: float = 3e-3) -> list:
    """On every rank: train the sharded model with Adam for ``steps`` steps under ``bug``; returns the global
    training loss (mean over every rank's tokens) at each step, the same list on every rank."""
    _check_bug(bug)
    groups = layout(world, ep)
    rank = dist.get_rank()
    teacher = _teacher(seed, d)
    net = _shard(_reference(d, h, ne * ep, seed), d, h, ne, ep, groups)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _data(seed, step, rank, tokens, d, teacher)
        losses.append(_backward(net, x, y, bug, groups))
        opt.step()
    return losses
