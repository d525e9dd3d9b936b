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

``world_size > 1`` exchanges rows with ``all_to_all`` over the group given to :func:`ensure_comm` (default:
every rank), so these run on gloo. Where fastmoe's CUDA kernels leave an order open (positions within an
expert) this file picks the deterministic one: flattened order. ``limit_by_capacity`` is
``labutils.moe.capacity``'s (the one capacity cut of the core), re-exported under fastmoe's module name.
The lab's own step-by-step API (``labutils.moe.count_by_gate`` returning ``(pos, counts)``, ``scatter``,
``gather``, ``combine``) stays in ``functions.py``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...collectives import all_gather_variable_dim, require_process_group
from ..capacity import exchange_counts, limit_by_capacity
from ..tree import tree_flatten, tree_map

__all__ = ["ensure_comm", "get_moe_group", "count_by_gate", "prepare_forward", "MOEScatter", "MOEGather",
           "AllGather", "Slice", "limit_by_capacity", "mark_module_parallel_comm", "_fmoe_general_global_forward"]

_moe_group: Any = None
DP_COMM = "dp_comm"  # the parameter attribute fastmoe's DistributedGroupedDataParallel reads


def ensure_comm(t: torch.Tensor, comm=None) -> None:
    """fastmoe's communicator set-up: remember ``comm`` (``None``: every rank) as the expert-parallel group."""
    del t  # fastmoe builds an NCCL communicator on t's device; torch.distributed needs nothing
    require_process_group(comm, what="ensure_comm")
    global _moe_group
    _moe_group = comm


def get_moe_group():
    """The group given to the last :func:`ensure_comm` (``None``: the default group)."""
    return _moe_group


def mark_module_parallel_comm(module: torch.nn.Module, comm: str) -> None:
    """Tag every parameter of ``module`` with ``dp_comm = comm`` (read by ``DistributedGroupedDataParallel``)."""
    for p in module.parameters():
        setattr(p, DP_COMM, comm)


# ---- counts ----------------------------------------------------------------------------------------
def _check_ids(flat: torch.Tensor, tot_expert: int) -> None:
    if flat.dtype.is_floating_point or flat.dtype == torch.bool:
        raise TypeError(f"the gate must hold integer expert ids, got dtype {flat.dtype}")
    if flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo < -1 or hi >= tot_expert:
            raise ValueError(f"gate holds expert ids in [{lo}, {hi}]; expected -1 (dropped) or "
                             f"0..{tot_expert - 1} (num_expert * world_size - 1)")


def count_by_gate(gate: torch.Tensor, num_expert: int, world_size: int, require_pos: bool = True):
    """fastmoe's ``count_by_gate``: ``(pos, local_expert_count, global_expert_count)``.

    ``gate``: expert ids of any shape (``(T,)`` or ``(T, k)``), ``-1`` = dropped. ``pos`` ``(N,)`` int64: the
    flattened positions of the kept choices sorted by expert (``None`` unless ``require_pos``);
    ``local_expert_count`` ``(world_size*num_expert,)`` int64: choices for each global expert;
    ``global_expert_count``: the same counts as received, entry ``w*num_expert + e`` = rows rank ``w`` sends
    to this rank's expert ``e`` (one ``all_to_all`` when ``world_size > 1``).
    """
    tot = num_expert * world_size
    with torch.no_grad():
        _check_ids(gate, tot)
        flat = gate.reshape(-1).long()                                        # (T*k,)
        key = torch.where(flat >= 0, flat, torch.full_like(flat, tot))
        lec = torch.bincount(key, minlength=tot + 1)[:tot]                    # (W*E,)
        gec = exchange_counts(lec, world_size, get_moe_group()) if world_size > 1 else lec
        pos = None
        if require_pos:
            pos = torch.argsort(key, stable=True)[: int(lec.sum())]           # (N,)
    return pos, lec, gec


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


# ---- moving rows between ranks (what fastmoe's global_scatter / global_gather kernels do) ----------
def _local_order(gec: torch.Tensor, num_expert: int) -> torch.Tensor:
    """Received rows come ordered (source rank, expert); this permutation makes them (expert, source rank)."""
    counts = gec.long().cpu()
    block = torch.repeat_interleave(torch.arange(counts.numel()), counts)       # block of each received row
    world = counts.numel() // num_expert
    return torch.argsort((block % num_expert) * world + torch.div(block, num_expert, rounding_mode="floor"),
                         stable=True)


def _rows_per_rank(counts: torch.Tensor, world_size: int) -> list:
    return counts.long().cpu().view(world_size, -1).sum(1).tolist()


def _global_scatter(buf: torch.Tensor, lec, gec, world_size: int) -> torch.Tensor:
    """Rows sorted by global expert -> rows this rank's experts run, ordered (local expert, source rank)."""
    send, recv = _rows_per_rank(lec, world_size), _rows_per_rank(gec, world_size)
    out = buf.new_empty((sum(recv),) + tuple(buf.shape[1:]))
    dist.all_to_all_single(out, buf.contiguous(), recv, send, group=get_moe_group())
    perm = _local_order(gec, lec.numel() // world_size).to(out.device)
    return out.index_select(0, perm)


def _global_gather(buf: torch.Tensor, lec, gec, world_size: int) -> torch.Tensor:
    """Inverse of :func:`_global_scatter`: expert outputs back to the ranks (and order) they came from."""
    send, recv = _rows_per_rank(lec, world_size), _rows_per_rank(gec, world_size)
    perm = _local_order(gec, lec.numel() // world_size).to(buf.device)
    by_source = buf.index_select(0, torch.argsort(perm))                         # (source rank, expert)
    out = buf.new_empty((sum(send),) + tuple(buf.shape[1:]))
    dist.all_to_all_single(out, by_source.contiguous(), send, recv, group=get_moe_group())
    return out


class MOEScatter(torch.autograd.Function):
    """``inp`` rows ``pos`` (token ids, i.e. flattened choice // top_k) -> the buffer this rank's experts run.

    ``forward(inp, pos, local_expert_count, global_expert_count, fwd_batch_size, world_size)``; backward sums
    the gradient of every copy of a row (``index_add``), after the reverse exchange when ``world_size > 1``.
    """

    @staticmethod
    def forward(ctx, inp, pos, local_expert_count, global_expert_count, fwd_batch_size, world_size):
        buf = inp.index_select(0, pos)                                            # (N_local, ...)
        if world_size > 1:
            buf = _global_scatter(buf, local_expert_count, global_expert_count, world_size)
        if buf.shape[0] != fwd_batch_size:
            raise ValueError(f"MOEScatter: fwd_batch_size={fwd_batch_size} but the counts give {buf.shape[0]} rows")
        ctx.save_for_backward(pos, local_expert_count, global_expert_count)
        ctx.moe_args = inp.shape[0], world_size
        return buf

    @staticmethod
    def backward(ctx, grad):
        pos, lec, gec = ctx.saved_tensors
        num_rows, world_size = ctx.moe_args
        if world_size > 1:
            grad = _global_gather(grad.contiguous(), lec, gec, world_size)
        grad_in = grad.new_zeros((num_rows,) + tuple(grad.shape[1:]))
        return grad_in.index_add_(0, pos, grad), None, None, None, None, None


class MOEGather(torch.autograd.Function):
    """Expert outputs -> ``(local_batch_size, ...)`` with row ``pos[i]`` = output ``i``; zeros elsewhere.

    ``forward(global_output_buf, pos, local_expert_count, global_expert_count, local_batch_size, world_size)``.
    """

    @staticmethod
    def forward(ctx, global_output_buf, pos, local_expert_count, global_expert_count, local_batch_size,
                world_size):
        buf = global_output_buf
        if world_size > 1:
            buf = _global_gather(buf, local_expert_count, global_expert_count, world_size)
        out = buf.new_zeros((local_batch_size,) + tuple(buf.shape[1:]))
        out.index_copy_(0, pos, buf)
        ctx.save_for_backward(pos, local_expert_count, global_expert_count)
        ctx.moe_args = world_size
        return out

    @staticmethod
    def backward(ctx, grad):
        pos, lec, gec = ctx.saved_tensors
        grad_buf = grad.contiguous().index_select(0, pos)
        if ctx.moe_args > 1:
            grad_buf = _global_scatter(grad_buf, lec, gec, ctx.moe_args)
        return grad_buf, None, None, None, None, None


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


# ---- slice_group (fastmoe's Slice and AllGather) --------------------------------------------------
def slice_sizes(num_rows: int, slice_size: int) -> list:
    """Rows each slice rank takes: ``torch.tensor_split``'s sizes (the first ``num_rows % n`` get one more)."""
    return [len(r) for r in torch.arange(num_rows).tensor_split(slice_size)]


class Slice(torch.autograd.Function):
    """``forward(inp, rank, world_size, group)``: this rank's slice of a batch every rank of ``group`` holds.

    Backward all-gathers the slices' gradients, so each rank gets the gradient of the whole (replicated)
    input. Unlike fastmoe (``B // world_size`` rows each, the remainder dropped) an uneven batch is split as
    ``torch.tensor_split`` does, so no row is lost.
    """

    @staticmethod
    def forward(ctx, inp, rank, world_size, group):
        sizes = slice_sizes(inp.shape[0], world_size)
        ctx.sizes, ctx.group = sizes, group
        start = sum(sizes[:rank])
        return inp[start:start + sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        full, _ = all_gather_variable_dim(grad.contiguous(), 0, sizes=torch.tensor(ctx.sizes), group=ctx.group)
        return full, None, None, None


class AllGather(torch.autograd.Function):
    """``forward(inp, rank, world_size, group)``: every rank's rows, rank order; backward keeps own slice."""

    @staticmethod
    def forward(ctx, inp, rank, world_size, group):
        out, sizes = all_gather_variable_dim(inp.contiguous(), 0, group=group)
        sizes = [int(s) for s in sizes.tolist()]
        if len(sizes) != world_size:
            raise ValueError(f"AllGather: world_size={world_size} but the group has {len(sizes)} ranks")
        ctx.start, ctx.rows = sum(sizes[:rank]), sizes[rank]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.rows], None, None, None
