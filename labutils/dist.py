"""Collectives for expert parallelism. (Taught in chapter 06.)

``all_to_all`` moves rows between ranks with per-rank split sizes and is differentiable: its backward is
the reverse all-to-all (the split sizes swap roles).

The all-gather helpers handle ranks holding different batch sizes (pad to the largest, gather, drop the
padding): ``all_gather_same_dim``, ``gather_sizes``, ``all_gather_variable_dim``, the differentiable
``all_gather`` / ``AllGather`` (gradient: own slice, or summed over ranks) and ``split_by_rank``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _require_pg(group=None):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no torch.distributed process group: run inside labutils.launch(...) workers or "
                           "call torch.distributed.init_process_group first")
    return group


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.output_split_sizes, ctx.input_split_sizes, ctx.group = output_split_sizes, input_split_sizes, group
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.input_split_sizes),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group=None) -> torch.Tensor:
    """Differentiable all-to-all along dim 0.

    ``x`` (sum(input_split_sizes), ...) is cut into pieces of ``input_split_sizes`` rows; piece r goes to
    rank r. Returns (sum(output_split_sizes), ...) holding, in rank order, the rows each rank sent here.
    """
    _require_pg(group)
    world = dist.get_world_size(group)
    input_split_sizes = [int(s) for s in input_split_sizes]
    output_split_sizes = [int(s) for s in output_split_sizes]
    if len(input_split_sizes) != world or len(output_split_sizes) != world:
        raise ValueError(f"split sizes need one entry per rank (world size {world}); got "
                         f"{len(input_split_sizes)} input and {len(output_split_sizes)} output entries")
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows")
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


def all_gather_same_dim(t: torch.Tensor, group=None) -> list:
    """Every rank's ``t`` (all of the same shape) as a list indexed by rank. Not differentiable."""
    _require_pg(group)
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def gather_sizes(t: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """``(world_size,)`` int64: the size of ``dim`` on every rank."""
    size = torch.tensor(t.shape[dim], device=t.device, dtype=torch.long)
    return torch.stack(all_gather_same_dim(size, group))


def all_gather_variable_dim(t: torch.Tensor, dim: int = 0, sizes=None, group=None):
    """Concatenate every rank's ``t`` along ``dim`` when ranks hold different sizes there.

    Collectives need equal shapes, so: gather the sizes (unless given), pad every rank to the largest,
    all-gather, then drop the padding. Returns ``(gathered, sizes)``; ``gathered`` has ``sum(sizes)``
    entries along ``dim``, rank 0's first. Not differentiable: use :func:`all_gather` for autograd.
    """
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
        return torch.cat(all_gather_same_dim(t, group), dim=dim), sizes
    pieces = all_gather_same_dim(pad_dim_to(t, longest, dim), group)       # W x (..., longest, ...)
    kept = [p.narrow(dim, 0, s) for p, s in zip(pieces, sizes_list)]        # drop each rank's padding
    return torch.cat(kept, dim=dim), sizes


class AllGatherFunction(torch.autograd.Function):
    """Autograd all-gather along ``dim`` with per-rank sizes. See :func:`all_gather` for the gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, grad, group):
        gathered, sizes = all_gather_variable_dim(x, dim=dim, sizes=sizes, group=group)
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
        return mine.contiguous(), None, None, None, None


def all_gather(x: torch.Tensor, dim: int = 0, sizes=None, grad: str = "slice", group=None):
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
    """
    _require_pg(group)
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
    return AllGatherFunction.apply(x, dim, sizes, grad, group)


class AllGather(torch.nn.Module):
    """Module form of :func:`all_gather` (as st-moe's ``AllGather``): ``forward(x, sizes=None)``."""

    def __init__(self, *, dim: int = 0, grad: str = "slice"):
        super().__init__()
        if grad not in ("slice", "sum"):
            raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
        self.dim, self.grad = dim, grad

    def forward(self, x, sizes=None):
        return all_gather(x, self.dim, sizes, self.grad)


def split_by_rank(x):
    """This rank's entry of a per-rank sequence, and every entry's size along dim 0.

    ``x`` is a tuple/list with one tensor per rank (sizes: each tensor's ``shape[0]``) or a tensor whose
    dim 0 is the rank (sizes: ``shape[1]`` for every rank). Returns ``(x[rank], sizes)``.
    """
    _require_pg()
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(x) != world:
        raise ValueError(f"split_by_rank needs one entry per rank ({world}), got {len(x)}")
    out = x[rank]
    if isinstance(x, (tuple, list)):
        sizes = [t.shape[0] for t in x]
    else:
        sizes = [x.shape[1]] * x.shape[0]
    return out, torch.tensor(sizes, device=out.device, dtype=torch.long)
