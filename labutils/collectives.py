"""Collectives for expert parallelism. (Taught in chapter 06.)

``all_to_all`` moves rows between ranks with per-rank split sizes and is differentiable: its backward is
the reverse all-to-all (the split sizes swap roles).

The all-gather helpers handle ranks holding different batch sizes (pad to the largest, gather, drop the
padding): ``all_gather_same_dim``, ``gather_sizes``, ``all_gather_variable_dim``, the differentiable
``all_gather`` / ``AllGather`` (gradient: own slice, or summed over ranks), ``split_by_rank``, and its adjoint
``Slice`` (this rank's rows of a replicated batch; the gradient is all-gathered).

Bad input fails on every rank alike, before any data moves: with ``check=True`` (the default) each of these
first all-gathers one small int64 row per rank (dtype, shape, ``sizes=`` or split sizes) and raises
:class:`CollectiveMismatch` (a ValueError; IndexError for a ``dim`` out of range) naming every rank's value
when they disagree. Without it gloo aborts the process (SIGABRT), reads one dtype's bits as another's or
returns rows nobody sent. ``check=False`` skips that collective where the sizes come from an exchange.
The checks themselves live in :mod:`labutils.agreement` (the lab's one cross-rank agreement check).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._deprecate import forward_moved
from .agreement import (
    BAD_DIM,
    MAX_DIMS,
    ZERO_DIM,
    check_all_to_all,
    check_gather,
    local_problem,
    require_process_group,  # the lab's one process-group check (its address: labutils.agreement)
)

__all__ = ["all_to_all", "pad_dim_to", "all_gather_same_dim", "gather_sizes", "all_gather_variable_dim",
           "AllGatherFunction", "all_gather", "AllGather", "slice_sizes", "rank_slice", "Slice", "split_by_rank"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.output_split_sizes, ctx.input_split_sizes, ctx.group = output_split_sizes, input_split_sizes, group
        out = x.new_zeros((sum(output_split_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_zeros((sum(ctx.input_split_sizes),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group=None, *,
               check: bool = True) -> torch.Tensor:
    """Differentiable all-to-all along dim 0.

    ``x`` (sum(input_split_sizes), ...) is cut into pieces of ``input_split_sizes`` rows; piece r goes to
    rank r. Returns (sum(output_split_sizes), ...) holding, in rank order, the rows each rank sent here.

    ``check=True`` first all-gathers every rank's split sizes, dtype and trailing shape (one small int64
    all_gather, ``W * (2W + 19)`` numbers) and raises the same clear error on every rank when rank r expects
    a different number of rows from rank s than s sends it, or the ranks' dtypes or trailing dims differ:
    without it such a call returns rows nobody sent. A hot path whose split sizes come from an exchange
    (``moe.expert_parallel`` derives them from an all_to_all of counts) may pass ``check=False`` to skip
    that extra collective (its cost is one small collective's latency, paid once per call).
    """
    require_process_group(group)
    world = dist.get_world_size(group)
    input_split_sizes = [int(s) for s in input_split_sizes]
    output_split_sizes = [int(s) for s in output_split_sizes]
    problem = ""
    if len(input_split_sizes) != world or len(output_split_sizes) != world:
        problem = (f"split sizes need one entry per rank (world size {world}); got "
                   f"{len(input_split_sizes)} input and {len(output_split_sizes)} output entries")
    elif x.dim() == 0:
        problem = "x is a 0-d tensor; all_to_all cuts rows along dim 0"
    elif sum(input_split_sizes) != x.shape[0]:
        problem = f"input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows"
    elif min(input_split_sizes + output_split_sizes) < 0:
        problem = f"split sizes must be >= 0, got input {input_split_sizes} and output {output_split_sizes}"
    elif x.dim() > MAX_DIMS and check:
        problem = f"x has ndim={x.dim()} (the checked all_to_all takes at most {MAX_DIMS}; pass check=False)"
    if not check:
        if problem:
            raise ValueError(f"all_to_all: {problem}")
        return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
    check_all_to_all(x, output_split_sizes, input_split_sizes, problem, group)
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


# --------------------------------------------------------------------------------------------------
# all-gather helpers (after lucidrains/st-moe-pytorch's distributed.py; taught in chapter 06)
# --------------------------------------------------------------------------------------------------
def pad_dim_to(t: torch.Tensor, length: int, dim: int = 0) -> torch.Tensor:
    """Zero-pad ``t`` at the end of ``dim`` up to ``length`` entries."""
    pad = length - t.shape[dim]
    if pad < 0:
        raise ValueError(f"cannot pad dim {dim} of size {t.shape[dim]} down to {length}")
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def all_gather_same_dim(t: torch.Tensor, group=None, *, check: bool = True) -> list:
    """Every rank's ``t`` (all of the same shape and dtype) as a list indexed by rank. Not differentiable.

    ``check=True`` exchanges dtype and shape first (one small all_gather) and raises the same error on every
    rank when they differ; ``check=False`` skips that collective (then a mismatch may crash or hang gloo)."""
    require_process_group(group)
    if check:
        check_gather(t, None, None, group, "all_gather_same_dim")
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def gather_sizes(t: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """``(world_size,)`` int64: the size of ``dim`` on every rank."""
    code, text = local_problem(t, dim)
    if code == ZERO_DIM:
        raise ValueError(f"gather_sizes: this rank {text}")
    if code == BAD_DIM:
        raise IndexError(f"gather_sizes: this rank {text}")
    size = torch.tensor(t.shape[dim], device=t.device, dtype=torch.long)
    return torch.stack(all_gather_same_dim(size, group, check=False))


def all_gather_variable_dim(t: torch.Tensor, dim: int = 0, sizes=None, group=None, *, check: bool = True):
    """Concatenate every rank's ``t`` along ``dim`` when ranks hold different sizes there.

    Collectives need equal shapes, so: gather the sizes (unless given), pad every rank to the largest,
    all-gather, then drop the padding. Returns ``(gathered, sizes)``; ``gathered`` has ``sum(sizes)``
    entries along ``dim``, rank 0's first. Not differentiable: use :func:`all_gather` for autograd.

    ``check=True`` (default) gathers, in the one collective that gathers the sizes, every rank's dtype, other
    dims and given ``sizes=`` too, and raises the same error on every rank before the data moves when they
    disagree (a 0-d tensor or ``dim`` out of range raise on every rank as well). Cost: one int64 all_gather of
    ``W * (W + 20)`` numbers, which replaces the sizes gather, so it is one extra collective only when
    ``sizes=`` is given. ``check=False`` trusts ``sizes=`` and skips it.
    """
    require_process_group(group)
    if check:
        actual = check_gather(t, dim, sizes, group, "all_gather_variable_dim")
        dim = dim % t.dim()
        sizes = torch.tensor(actual, dtype=torch.long, device=t.device) if sizes is None else \
            torch.as_tensor(sizes, dtype=torch.long)
    else:
        code, text = local_problem(t, dim)
        if code in (ZERO_DIM, BAD_DIM):  # not TOO_MANY_DIMS: check=False is what takes more than MAX_DIMS dims
            raise (IndexError if code == BAD_DIM else ValueError)(f"all_gather_variable_dim: this rank {text}")
        dim = dim % t.dim()
        sizes = gather_sizes(t, dim, group) if sizes is None else torch.as_tensor(sizes, dtype=torch.long)
    sizes_list = [int(s) for s in sizes.tolist()]
    if len(sizes_list) != dist.get_world_size(group):
        raise ValueError(f"sizes has {len(sizes_list)} entries for {dist.get_world_size(group)} ranks")
    if sizes_list[dist.get_rank(group)] != t.shape[dim]:
        raise ValueError(f"sizes says this rank holds {sizes_list[dist.get_rank(group)]} entries along dim {dim} "
                         f"but t has {t.shape[dim]}")
    longest = max(sizes_list)
    if all(s == longest for s in sizes_list):
        return torch.cat(all_gather_same_dim(t, group, check=False), dim=dim), sizes
    pieces = all_gather_same_dim(pad_dim_to(t, longest, dim), group, check=False)   # W x (..., longest, ...)
    kept = [p.narrow(dim, 0, s) for p, s in zip(pieces, sizes_list)]                  # drop each rank's padding
    return torch.cat(kept, dim=dim), sizes


class AllGatherFunction(torch.autograd.Function):
    """Autograd all-gather along ``dim`` with per-rank sizes. See :func:`all_gather` for the gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, grad, group, check=True):
        gathered, sizes = all_gather_variable_dim(x, dim=dim, sizes=sizes, group=group, check=check)
        sizes = sizes.clone()  # never hand an input back as an output
        ctx.sizes = [int(s) for s in sizes.tolist()]
        ctx.dim, ctx.grad, ctx.group = dim % x.dim(), grad, group
        ctx.mark_non_differentiable(sizes)
        return gathered, sizes

    @staticmethod
    def backward(ctx, grad_gathered, _grad_sizes):
        if ctx.grad == "sum":  # every rank's gradient for my slice, summed: a reduce-scatter
            grad_gathered = grad_gathered.contiguous().clone()
            dist.all_reduce(grad_gathered, group=ctx.group)
        mine = grad_gathered.split(ctx.sizes, dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None, None, None, None


def all_gather(x: torch.Tensor, dim: int = 0, sizes=None, grad: str = "slice", group=None, *, check: bool = True):
    """Differentiable all-gather of ranks holding different sizes along ``dim``: ``(gathered, sizes)``.

    The backward has two correct answers, depending on what happens downstream of the gather:

    * ``grad="slice"`` (lucidrains/st-moe's ``AllGather``): each rank keeps its own slice of ITS gradient.
      Right when the computation after the gather is *replicated*: every rank computes the same function
      of the same gathered tensor and the loss counts it once. Each rank already holds the full gradient
      of the gathered tensor, so its own slice is the gradient of its input. No communication.
    * ``grad="sum"``: the gradient of rank r's slice is the SUM over ranks of each rank's gradient for
      that slice (a reduce-scatter). Right when ranks do *different* things with the gathered tensor
      (each runs different experts on it, or computes its own loss from it) and the total loss is the sum
      of the ranks' losses. Done here as all_reduce + slice, which also works on gloo (no reduce-scatter
      there) and with unequal sizes; it moves W times more than a true reduce-scatter.

    Use "slice" where "sum" is needed and gradients silently lose the other ranks' contributions; use
    "sum" on replicated computation and they come out W times too large. (Taught in chapter 06.)

    ``check``: as in :func:`all_gather_variable_dim` (ranks' dtypes, dims and ``sizes=`` checked on every rank
    before data moves; ``check=False`` skips that collective).
    """
    require_process_group(group)
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
    return AllGatherFunction.apply(x, dim, sizes, grad, group, check)


class AllGather(torch.nn.Module):
    """Module form of :func:`all_gather` (as st-moe's ``AllGather``): ``forward(x, sizes=None)``."""

    def __init__(self, *, dim: int = 0, grad: str = "slice", check: bool = True):
        super().__init__()
        if grad not in ("slice", "sum"):
            raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
        self.dim, self.grad, self.check = dim, grad, check

    def forward(self, x, sizes=None):
        return all_gather(x, self.dim, sizes, self.grad, check=self.check)


def slice_sizes(num_rows: int, slice_size: int) -> list:
    """Rows each of ``slice_size`` ranks takes of a batch: ``torch.tensor_split``'s sizes (the first
    ``num_rows % slice_size`` get one more)."""
    return [len(r) for r in torch.arange(num_rows).tensor_split(slice_size)]


def rank_slice(t: torch.Tensor, rank: int, slice_size: int) -> torch.Tensor:
    """The rows of ``t`` (dim 0) rank ``rank`` of ``slice_size`` takes, as :func:`slice_sizes` splits them."""
    sizes = slice_sizes(t.shape[0], slice_size)
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


class Slice(torch.autograd.Function):
    """fastmoe's ``Slice.apply(inp, rank, world_size, group)``: this rank's slice of a batch every rank of
    ``group`` holds (:func:`rank_slice`). Backward all-gathers the slices' gradients, so each rank gets the
    gradient of the whole (replicated) input. Unlike fastmoe (``B // world_size`` rows each, the remainder
    dropped) an uneven batch is split as ``torch.tensor_split`` does, so no row is lost. (Chapter 01's
    ``slice_group``.)"""

    @staticmethod
    def forward(ctx, inp, rank, world_size, group):
        ctx.sizes, ctx.group = slice_sizes(inp.shape[0], world_size), group
        return rank_slice(inp, rank, world_size)

    @staticmethod
    def backward(ctx, grad):
        full, _ = all_gather_variable_dim(grad.contiguous(), 0, sizes=torch.tensor(ctx.sizes), group=ctx.group)
        return full, None, None, None


def split_by_rank(x):
    """This rank's entry of a per-rank sequence, and every entry's size along dim 0.

    ``x`` is a tuple/list with one tensor per rank (sizes: each tensor's ``shape[0]``) or a tensor whose
    dim 0 is the rank (sizes: ``shape[1]`` for every rank). Returns ``(x[rank], sizes)``.
    """
    require_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(x) != world:
        raise ValueError(f"split_by_rank needs one entry per rank ({world}), got {len(x)}")
    out = x[rank]
    if isinstance(x, (tuple, list)):
        sizes = [t.shape[0] for t in x]
    else:
        sizes = [x.shape[1]] * x.shape[0]
    return out, torch.tensor(sizes, device=out.device, dtype=torch.long)
