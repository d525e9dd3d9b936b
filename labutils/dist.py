"""Collectives for expert parallelism. (Taught in chapter 06.)

``all_to_all`` moves rows between ranks with per-rank split sizes and is differentiable: its backward is
the reverse all-to-all (the split sizes swap roles).
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
