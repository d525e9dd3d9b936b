"""fastmoe's functional API in plain PyTorch: the names of ``fmoe.functions`` and friends. (Taught in chapter 01.)

Same signatures and results as fastmoe (laekov/fastmoe ``fmoe/functions.py``, ``fmoe/layers.py``,
``fmoe/gates/utils.py``), written with torch ops and ``torch.distributed`` collectives instead of CUDA kernels:

    count_by_gate(gate, num_expert, world_size, require_pos=True) -> (pos, local_expert_count, global_expert_count)
    prepare_forward(gate, num_expert, world_size) -> (pos, lec, gec, fwd_expert_count, fwd_batch_size)
    MOEScatter.apply(inp, pos // top_k, lec, gec, fwd_batch_size, world_size)   # -> expert-contiguous buffer
    MOEGather.apply(buf, pos, lec, gec, out_batch_size, world_size)             # -> (T*k, d), zeros where dropped
    _fmoe_general_global_forward(inp, gate, expert_fn, num_expert, world_size)  # the four above in a row
    limit_by_capacity(topk_idx, num_expert, world_size, capacity) -> (new_lec, new_gec, topk_idx)  # capacity.py
    Slice / AllGather                                                           # slice_group's two steps

A thin face: each name adapts one of the core's steps to fastmoe's signature, never a second implementation.
``world_size > 1`` moves rows with ``expert_parallel.to_experts`` / ``from_experts`` over the group given to
:func:`ensure_comm` (default: every rank), on gloo too. Positions within an expert, which fastmoe's CUDA kernels
leave open, are in flattened order.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..._deprecate import forward_moved
from ...agreement import require_process_group
from ...collectives import Slice, all_gather
from .. import functions as core
from ..capacity import exchange_counts
from ..capacity import limit_by_capacity as _limit_by_capacity
from ..expert_parallel import from_experts, to_experts
from ..layers import mark_module_parallel_comm
from ..tree import tree_flatten, tree_map

__all__ = ["ensure_comm", "get_moe_group", "count_by_gate", "prepare_forward", "MOEScatter", "MOEGather",
           "AllGather", "Slice", "limit_by_capacity", "mark_module_parallel_comm", "_fmoe_general_global_forward"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)

_moe_group: Any = None


def ensure_comm(t: torch.Tensor, comm=None) -> None:
    """fastmoe's communicator set-up: remember ``comm`` (``None``: every rank) as the expert-parallel group."""
    del t  # fastmoe builds an NCCL communicator on t's device; torch.distributed needs nothing
    require_process_group(comm, what="ensure_comm")
    global _moe_group
    _moe_group = comm


def get_moe_group():
    """The group given to the last :func:`ensure_comm` (``None``: the default group)."""
    return _moe_group


def count_by_gate(gate: torch.Tensor, num_expert: int, world_size: int, require_pos: bool = True):
    """fastmoe's ``count_by_gate``: ``(pos, local_expert_count, global_expert_count)``.

    ``gate``: expert ids of any shape (``(T,)`` or ``(T, k)``), ``-1`` = dropped. ``pos`` ``(N,)`` int64: the
    flattened positions of the kept choices sorted by expert (``None`` unless ``require_pos``);
    ``local_expert_count`` ``(world_size*num_expert,)`` int64: choices for each global expert;
    ``global_expert_count``: the same counts as received, entry ``w*num_expert + e`` = rows rank ``w`` sends
    to this rank's expert ``e`` (one ``all_to_all`` when ``world_size > 1``). The core's ``count_by_gate``.
    """
    with torch.no_grad():
        core.check_expert_ids(gate, num_expert * world_size, "the gate", dtype_error=TypeError)
        pos, lec = core.count_by_gate(gate.long(), num_expert, world_size)     # (N,), (W*E,)
        gec = exchange_counts(lec, world_size, get_moe_group()) if world_size > 1 else lec
    return (pos if require_pos else None), lec, gec


def prepare_forward(gate: torch.Tensor, num_expert: int, world_size: int):
    """``(pos, lec, gec, fwd_expert_count, fwd_batch_size)``: counts on the CPU, as fastmoe returns them.

    ``fwd_expert_count`` ``(num_expert,)``: rows each LOCAL expert runs (summed over source ranks);
    ``fwd_batch_size``: their total, the size of the expert-contiguous buffer on this rank.
    """
    pos, lec, gec = count_by_gate(gate, num_expert, world_size)
    assert pos is not None  # require_pos=True
    with torch.no_grad():
        fwd_expert_count = gec.view(world_size, num_expert).sum(dim=0)
        fwd_batch_size = int(fwd_expert_count.sum())
    return pos, lec.cpu(), gec.cpu(), fwd_expert_count.cpu(), fwd_batch_size


class MOEScatter:
    """fastmoe's ``MOEScatter.apply(inp, pos, local_expert_count, global_expert_count, fwd_batch_size,
    world_size)``: ``inp`` rows ``pos`` (token ids, i.e. flattened choice // top_k) -> the buffer this rank's
    experts run. The core's scatter (``functions.MOEScatter``: backward sums the gradient of every copy of a row),
    then ``expert_parallel.to_experts`` when ``world_size > 1``."""

    @staticmethod
    def apply(inp, pos, local_expert_count, global_expert_count, fwd_batch_size, world_size):
        buf = core.MOEScatter.apply(inp, pos)                                     # (N_local, ...)
        if world_size > 1:
            buf = to_experts(buf, local_expert_count, global_expert_count, get_moe_group())[0]
        if buf.shape[0] != fwd_batch_size:
            raise ValueError(f"MOEScatter: fwd_batch_size={fwd_batch_size} but the counts give {buf.shape[0]} rows")
        return buf


class MOEGather:
    """fastmoe's ``MOEGather.apply(global_output_buf, pos, local_expert_count, global_expert_count,
    local_batch_size, world_size)``: expert outputs -> ``(local_batch_size, ...)`` with row ``pos[i]`` = output
    ``i``, zeros elsewhere. ``expert_parallel.from_experts`` when ``world_size > 1``, then the core's gather."""

    @staticmethod
    def apply(global_output_buf, pos, local_expert_count, global_expert_count, local_batch_size, world_size):
        buf = global_output_buf
        if world_size > 1:
            buf = from_experts(buf, local_expert_count, global_expert_count, get_moe_group())
        return core.gather(buf, pos, local_batch_size)


def _fmoe_general_global_forward(inp, gate, expert_fn: Callable, num_expert: int, world_size: int, **kwargs):
    """fastmoe's MoE step without the gate and the weighting: count, scatter, ``expert_fn``, gather.

    ``inp``: a tensor ``(T, d)`` or a tree of them; ``gate``: ``(T,)`` or ``(T, k)`` expert ids.
    Returns the same tree of ``(T*k, d)`` expert outputs in choice order, zero rows for dropped choices.
    ``expert_fn(x, fwd_expert_count)`` gets the scattered tree and CPU int64 counts. Extra keyword
    arguments (fastmoe passes ``experts=``) are accepted and unused, as there.
    """
    del kwargs
    pos, lec, gec, fwd_expert_count, fwd_batch_size = prepare_forward(gate, num_expert, world_size)
    top_k = gate.shape[1] if gate.dim() == 2 else 1
    rows = torch.div(pos, top_k, rounding_mode="floor")
    x = tree_map(lambda t: MOEScatter.apply(t, rows, lec, gec, fwd_batch_size, world_size), inp)
    x = expert_fn(x, fwd_expert_count)
    out_batch_size = tree_flatten(inp)[0][0].shape[0] * top_k
    return tree_map(lambda t: MOEGather.apply(t, pos, lec, gec, out_batch_size, world_size), x)


def limit_by_capacity(topk_idx: torch.Tensor, num_expert: int, world_size: int, capacity, group=None):
    """fastmoe's ``limit_by_capacity(topk_idx, num_expert, world_size, capacity)`` (``fmoe/gates/utils.py``):
    ``(new_lec, new_gec, topk_idx)``, the core's ``capacity.limit_by_capacity`` called with its keywords."""
    return _limit_by_capacity(topk_idx, num_expert, world_size=world_size, capacity=capacity, group=group)


class AllGather:
    """fastmoe's ``AllGather.apply(inp, rank, world_size, group)``: every rank's rows, in rank order; the gradient
    keeps this rank's own slice. ``labutils.collectives.all_gather(grad="slice")``."""

    @staticmethod
    def apply(inp, rank, world_size, group):
        out, sizes = all_gather(inp, 0, None, "slice", group)
        if len(sizes) != world_size or rank != dist.get_rank(group):
            raise ValueError(f"AllGather: rank={rank}, world_size={world_size}, but this is rank "
                             f"{dist.get_rank(group)} of a group of {len(sizes)}")
        return out
