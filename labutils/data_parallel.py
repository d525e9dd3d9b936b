"""MoE-aware data parallelism: average dense gradients, never mix experts. (Taught in chapter 07.)

A data-parallel wrapper (DDP, ``replicate``, ``fully_shard``) assumes every rank holds the same
parameters and averages every gradient over all ranks. With expert parallelism that is wrong: a
parameter called ``experts.0.w1`` is expert 0 on rank 0 and expert 1 on rank 1. Averaging mixes two
different experts, and DDP's start-up broadcast even overwrites every expert with rank 0's.

The fix (fastmoe's ``DistributedGroupedDataParallel``, DeepSpeed's expert parameter groups) tags each
parameter with the group its gradient is reduced over, in fastmoe's vocabulary (``p.dp_comm``):

* ``"dp"`` (the default, untagged parameters): dense; all-reduce over the data-parallel group and divide
  by its size, as DDP does;
* ``"gate"`` / ``"world"``: dense, reduced over every rank (fastmoe tags its gate ``"gate"``);
* ``"expert"`` / ``"none"`` (fastmoe's expert tag), or DeepSpeed's ``param.allreduce is False``: expert;
  all-reduce only over the *expert-data-parallel* group (ranks holding a replica of the same expert; none
  when every expert lives on exactly one rank, fastmoe's default: its ``DistributedGroupedDataParallel``
  reduces ``"none"`` only when given ``none_group=``).

:class:`GroupedDataParallel` (DeepSpeed's expert scale by default) and fastmoe's
:class:`DistributedGroupedDataParallel` (its constructor and division order) read the tags alike and reduce
through the same two functions: one flat all-reduce and one flat broadcast per group and dtype.

Scale of expert gradients: an expert already receives the gradients of the tokens of every rank in its
expert-parallel group (through the backward all-to-all), so after the expert-data-parallel sum it holds
the gradient of the SUM of all ranks' losses. ``expert_scale="mean"`` divides it by the data-parallel
world size, like DeepSpeed ("to keep gradients unaffected by ep_size"), which matches a single process
training on the global batch with a mean loss. ``expert_scale="sum"`` leaves it as fastmoe does (its
tests compare expert gradients with the SUM of per-rank reference gradients), i.e. experts then train
with a learning rate ``world_size`` times larger than the dense part.

Before anything moves (broadcast, each reduction) the ranks check that they hold the same parameter names, shapes,
dtypes and tags in the same order, and gradients for the same parameters (one small all-gather,
:func:`labutils.agreement.check_replicas`); else every rank raises the same ``CollectiveMismatch``, naming them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .agreement import check_replicas, require_process_group

# dp_comm tag -> which gradient group: "dp" (data-parallel group), "world" (every rank), "expert"
_TAGS = {"dp": "dp", "gate": "world", "world": "world", "expert": "expert", "none": "expert"}
_FASTMOE_TAGS = ("moe", "mp")  # DistributedGroupedDataParallel's other tags ("mp": reduced only given mp_group=)

__all__ = ["mark_expert_params", "grad_group", "is_expert_param", "split_dense_expert", "allreduce_grouped_grads",
           "broadcast_grouped_params", "GroupedDataParallel", "DistributedGroupedDataParallel"]


def mark_expert_params(module: nn.Module) -> nn.Module:
    """Tag every parameter of ``module`` as an expert parameter (``p.dp_comm = "expert"``); returns it."""
    for p in module.parameters():
        p.dp_comm = "expert"  # pyright: ignore[reportAttributeAccessIssue]  (a tag, as fastmoe sets)
    return module


def grad_group(p: torch.Tensor) -> str:
    """``"dp"``, ``"world"`` or ``"expert"``: the group ``p``'s gradient is reduced over (see the module doc)."""
    tag = getattr(p, "dp_comm", None)
    if tag is None:
        return "expert" if getattr(p, "allreduce", True) is False else "dp"
    if tag not in _TAGS:
        raise ValueError(f"unknown dp_comm {tag!r} on a parameter of shape {tuple(p.shape)}; "
                         f"expected one of {sorted(_TAGS)}")
    return _TAGS[tag]


def is_expert_param(p: torch.Tensor) -> bool:
    """True for an expert parameter: tagged ``"expert"``/``"none"`` or DeepSpeed's ``allreduce=False``."""
    return grad_group(p) == "expert"


def split_dense_expert(module: nn.Module) -> tuple[list, list]:
    """``(dense, expert)`` lists of ``(name, param)`` that require grad (e.g. for optimizer param groups)."""
    dense, expert = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (expert if is_expert_param(p) else dense).append((name, p))
    return dense, expert


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _first_rank(group) -> int:  # the first global rank of group (None: every rank), alike on each of its ranks
    return 0 if group is None else min(dist.get_process_group_ranks(group))


def _group_tag(p: torch.Tensor) -> tuple:
    try:
        return grad_group(p), ""
    except ValueError as exc:
        return "?", str(exc)


def _by_dtype(tensors: list) -> list:
    """``tensors`` in lists of one dtype each (first-seen order): one flat buffer per list."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return list(by_dtype.values())


def _allreduce_flat(tensors: list, group, divisor: float, *, divide_first: bool = False, fp32: bool = False) -> None:
    """Sum ``tensors`` over ``group`` in one flat buffer per dtype, divide by ``divisor``, write back.
    ``divide_first``: divide before the sum (fastmoe's default); ``fp32``: sum a low-precision buffer in float32."""
    for same in _by_dtype(tensors):
        flat = torch.cat([t.reshape(-1) for t in same])  # (sum numel,)
        if fp32 and flat.dtype != torch.float32:
            flat = flat.float()
        if divide_first:
            flat /= divisor
        dist.all_reduce(flat, group=group)
        if not divide_first:
            flat /= divisor
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))


@torch.no_grad()
def _broadcast_flat(tensors: list, group) -> None:
    """Copy ``tensors`` from the first rank of ``group`` (None: every rank) to the others, one buffer per dtype."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for same in _by_dtype(tensors):
        flat = torch.cat([t.reshape(-1) for t in same])  # (sum numel,)
        dist.broadcast(flat, src=src, group=group)
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))


def _check_grouped(module: nn.Module, dp_group, expert_dp_group, expert_scale: str, what: str, need_grad: bool):
    """The ranks of ``dp_group`` agree on parameters, groups and gradients (see the module doc)."""
    require_process_group(dp_group, what=what)
    experts = expert_dp_group is not None and _group_size(expert_dp_group) > 1
    reduced_over = {"dp": _first_rank(dp_group), "world": 0, "expert": _first_rank(expert_dp_group) if experts else -1}
    setup = {"expert_scale": expert_scale, "expert_dp_group": "given" if expert_dp_group is not None else None}
    check_replicas(module, _group_tag, reduced_over, setup, dp_group, what, need_grad, "gradient group")


def allreduce_grouped_grads(module: nn.Module, *, dp_group=None, expert_dp_group=None,
                            expert_scale: str = "mean") -> dict:
    """All-reduce gradients after ``backward()``: dense over ``dp_group``, experts over ``expert_dp_group``.

    ``dp_group``: the data-parallel group (``None``: the default group, every rank).
    ``expert_dp_group``: ranks that hold replicas of the same experts; ``None`` means every expert lives on
    one rank only, so expert gradients are not communicated at all.
    ``expert_scale``: "mean" (divide expert gradients by the data-parallel size, DeepSpeed) or "sum"
    (leave them, fastmoe). Returns how many gradient tensors went to each group (``dp``, ``world``, ``expert``).
    First the ranks of ``dp_group`` check that they agree (see the module doc): one small all-gather.
    """
    if expert_scale not in ("mean", "sum"):
        raise ValueError(f"expert_scale must be 'mean' or 'sum', not {expert_scale!r}")
    _check_grouped(module, dp_group, expert_dp_group, expert_scale, "allreduce_grouped_grads", need_grad=True)
    grads = {"dp": [], "world": [], "expert": []}
    for p in module.parameters():
        if p.requires_grad and p.grad is not None:
            grads[grad_group(p)].append(p.grad)
    for key, group in (("dp", dp_group), ("world", None)):
        if grads[key]:
            _allreduce_flat(grads[key], group, float(dist.get_world_size(group)))
    divisor = float(dist.get_world_size(dp_group)) if expert_scale == "mean" else 1.0
    if grads["expert"] and _group_size(expert_dp_group) > 1:
        _allreduce_flat(grads["expert"], expert_dp_group, divisor)
    elif grads["expert"] and divisor != 1.0:
        with torch.no_grad():
            for g in grads["expert"]:
                g /= divisor
    return {k: len(v) for k, v in grads.items()}


def broadcast_grouped_params(module: nn.Module, *, dp_group=None, expert_dp_group=None) -> None:
    """Make replicas equal at start: each parameter from the first rank of its group (``"dp"``: ``dp_group``,
    ``"world"``: every rank, ``"expert"``: ``expert_dp_group``; experts are left alone when that is ``None``,
    each rank keeps its own). The ranks check first that they hold the same parameters, tagged alike."""
    _check_grouped(module, dp_group, expert_dp_group, "", "broadcast_grouped_params", need_grad=False)
    groups = {"dp": dp_group, "world": None, "expert": expert_dp_group}
    params: dict = {"dp": [], "world": [], "expert": []}
    for p in module.parameters():
        params[grad_group(p)].append(p.data)
    for key, group in groups.items():
        if params[key] and not (key == "expert" and expert_dp_group is None):
            _broadcast_flat(params[key], group)


class GroupedDataParallel(nn.Module):
    """A minimal MoE-aware DDP: broadcast at wrap, call :meth:`allreduce_gradients` after ``backward()``.

    Like fastmoe's ``DistributedGroupedDataParallel`` (no automatic hooks: you call the reduction), with
    DeepSpeed's expert gradient scale by default. Parameters are tagged with :func:`mark_expert_params`.
    """

    def __init__(self, module: nn.Module, *, dp_group=None, expert_dp_group=None, expert_scale: str = "mean",
                 sync_params: bool = True):
        super().__init__()
        if expert_scale not in ("mean", "sum"):
            raise ValueError(f"expert_scale must be 'mean' or 'sum', not {expert_scale!r}")
        require_process_group(dp_group, what="GroupedDataParallel")
        self.module = module
        self.dp_group, self.expert_dp_group, self.expert_scale = dp_group, expert_dp_group, expert_scale
        if sync_params:
            broadcast_grouped_params(module, dp_group=dp_group, expert_dp_group=expert_dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def allreduce_gradients(self) -> dict:
        return allreduce_grouped_grads(self.module, dp_group=self.dp_group, expert_dp_group=self.expert_dp_group,
                                       expert_scale=self.expert_scale)


class DistributedGroupedDataParallel(nn.Module):
    """fastmoe's ``DistributedGroupedDataParallel``, same constructor and methods. (Taught in chapter 07.)

    The tags mean what they mean everywhere in this module (:func:`grad_group`): untagged or ``"dp"`` dense over
    the data-parallel group, ``"gate"`` / ``"world"`` dense over every rank, ``"none"`` (fastmoe's expert tag) an
    expert, reduced only over the ranks that hold a replica of it. fastmoe names each tag's group with a keyword
    ``<tag>_group=`` (``dp_group=``, ``gate_group=``, ``world_group=``, ``moe_group=``, ``mp_group=``, ...;
    ``dp``, ``gate``, ``moe`` and ``world`` default to every rank) and leaves a tag with no group alone: its
    experts have no replicas unless you pass ``none_group=``, so they keep their gradient, which already SUMS
    every rank's tokens through the backward all-to-all. That is :class:`GroupedDataParallel` with
    ``expert_dp_group=None, expert_scale="sum"``, and both reduce through the same flat all-reduce.

    ``allreduce_gradients(no_scale=False, reduce_after=False, fp32_allreduce=False)`` (alias
    ``allreduce_params``) is called by you after ``backward()``: each group's gradients are divided by its size
    before the sum (after it with ``reduce_after=True``, not at all with ``no_scale=True``), as fastmoe does.
    ``need_sync=True`` broadcasts every tagged group's parameters from the group's first rank at construction.
    """

    def __init__(self, module: nn.Module, auto_allreduce: bool = False, need_sync: bool = True, **kwargs):
        if auto_allreduce:
            raise NotImplementedError("auto_allreduce=True: fastmoe has not implemented it either; call "
                                      "model.allreduce_gradients() after backward()")
        super().__init__()
        self.module = module
        unknown = [k for k in kwargs if not k.endswith("_group")]
        if unknown:
            raise TypeError(f"DistributedGroupedDataParallel got {unknown}; its groups are keyword arguments "
                            f"ending in _group (dp_group=, mp_group=, gate_group=, moe_group=, world_group=)")
        require_process_group(what="DistributedGroupedDataParallel")
        self.comms = {k[:-len("_group")]: g for k, g in kwargs.items()}
        for tag in ("dp", "gate", "moe", "world"):
            if self.comms.get(tag) is None:
                self.comms[tag] = dist.group.WORLD
        if need_sync:
            self._agree("DistributedGroupedDataParallel (its start-up broadcast)", need_grad=False)
            self._sync_params()
        for name, p in module.named_parameters():
            if self._tag(p)[1]:
                raise ValueError(f"DistributedGroupedDataParallel: parameter {name!r}: {self._tag(p)[1]}")

    def _tag(self, p: torch.Tensor) -> tuple:
        """``(tag, problem)``: a tag with a group, or one fastmoe leaves alone ("none", "mp"...); others refused."""
        tag, known = getattr(p, "dp_comm", "dp"), sorted(set(_TAGS) | set(_FASTMOE_TAGS) | set(self.comms))
        return tag, "" if tag in known else (f"dp_comm={tag!r} on a parameter of shape {tuple(p.shape)} is not a tag "
                                             f"any group reduces; accepted: {known} (or reduce it over a group of "
                                             f"your own with {tag}_group=)")

    def _agree(self, what: str, need_grad: bool) -> None:
        reduced_over = {tag: _first_rank(g) for tag, g in self.comms.items()}
        check_replicas(self.module, self._tag, reduced_over, {"groups": sorted(self.comms)}, self.comms["world"],
                       what, need_grad, "dp_comm")

    def _by_comm(self, need_grad: bool) -> dict:
        """``tag -> [param]`` for every tag that has a group (fastmoe leaves the others alone)."""
        groups: dict = {}
        for p in self.module.parameters():
            if not need_grad or (p.requires_grad and p.grad is not None):
                groups.setdefault(getattr(p, "dp_comm", "dp"), []).append(p)
        return {tag: params for tag, params in groups.items() if tag in self.comms}

    def allreduce_gradients(self, no_scale: bool = False, reduce_after: bool = False,
                            fp32_allreduce: bool = False) -> None:
        """Average (``no_scale=True``: sum) each tagged group's gradients over its process group."""
        self._agree("DistributedGroupedDataParallel.allreduce_gradients", need_grad=True)
        for tag, params in self._by_comm(need_grad=True).items():
            comm = self.comms[tag]
            divisor = 1.0 if no_scale else float(dist.get_world_size(comm))
            _allreduce_flat([p.grad for p in params], comm, divisor, divide_first=not reduce_after,
                            fp32=fp32_allreduce)

    def allreduce_params(self, no_scale: bool = False, reduce_after: bool = False,
                         fp32_allreduce: bool = False) -> None:
        """fastmoe's alias of :meth:`allreduce_gradients`."""
        self.allreduce_gradients(no_scale, reduce_after, fp32_allreduce)

    def _sync_params(self) -> None:
        for tag, params in self._by_comm(need_grad=False).items():
            _broadcast_flat([p.data for p in params], self.comms[tag])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
