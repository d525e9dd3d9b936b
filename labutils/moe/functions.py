"""The named steps of an MoE forward, as in fastmoe's ``functions.py``. (Taught in chapter 01.)

    gate -> count_by_gate -> scatter -> run experts -> gather -> combine

Shapes: ``T`` tokens, ``k`` choices per token, ``E`` experts, ``N <= T*k`` kept choices.
``pos`` lists the kept choices (as indices into the flattened ``(T*k,)`` gate output) sorted by expert,
so ``x[pos // k]`` is the expert-contiguous input buffer. All steps are plain differentiable torch ops.
"""
from __future__ import annotations

import numbers

import torch

from ..data import _size
from .device_path import bincount, device_check


def _tot_expert(where: str, num_expert, world_size=1) -> int:
    """The core's check of ``num_expert`` and ``world_size``: each an int >= 1 (bools and floats refused), or a
    ValueError naming ``where``, the argument and its value. Returns ``num_expert * world_size``."""
    return _size(f"{where}: num_expert", num_expert) * _size(f"{where}: world_size", world_size)


def check_top_k(top_k, tot_expert: int) -> None:
    """The one top-k check of the lab: an int between 1 and the number of experts (all workers')."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {top_k!r} ({type(top_k).__name__})")
    if not 1 <= top_k <= tot_expert:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                         f"(world_size * num_expert = {tot_expert})")


def counts_list(counts) -> list:
    """Per-expert row counts as a list of Python ints, from a tensor (one ``.tolist()``) or any sequence."""
    return counts.tolist() if torch.is_tensor(counts) else [int(c) for c in counts]


def count_by_gate(gate_idx: torch.Tensor, num_expert: int, world_size: int = 1, keep_dropped: bool = False):
    """Tokens per expert and the order that makes each expert's tokens contiguous.

    ``gate_idx``: ``(T, k)`` expert ids in ``0 .. world_size*num_expert-1`` or ``-1`` (dropped).
    Returns ``pos`` ``(N,)`` int64 (stable: tokens keep their order within an expert) and
    ``local_expert_count`` ``(world_size*num_expert,)`` int64, the number of choices for each expert.
    (fastmoe also returns the count each worker RECEIVES; here the expert-parallel exchange computes it.)

    ``keep_dropped=True`` keeps the dropped choices at the end of ``pos`` (``N = T*k``) instead of cutting them
    off, which needs no host read of how many there are (the GPU path, ``dispatch.py``).

    Refuses ``num_expert`` or ``world_size`` that is not an int >= 1 (0 experts gave empty counts; a negative
    number torch's "minlength should be >= 0"), naming the argument and the value, before counting.
    """
    tot_expert = _tot_expert("count_by_gate", num_expert, world_size)
    flat = gate_idx.reshape(-1)                                          # (T*k,)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, tot_expert))
    counts = bincount(key, tot_expert + 1)[:tot_expert]                  # (E,) drops counted in the extra bin
    pos = torch.argsort(key, stable=True)                                # (T*k,) dropped choices last
    return (pos if keep_dropped else pos[: flat.numel() - int((flat < 0).sum())]), counts


class MOEScatter(torch.autograd.Function):
    """``x.index_select(0, rows)`` whose backward is one ``index_add_`` (fastmoe's MOEScatter, one worker)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        grad_x = grad.new_zeros((ctx.num_tokens,) + tuple(grad.shape[1:]))
        return grad_x.index_add_(0, rows, grad), None


class MOEGather(torch.autograd.Function):
    """Write rows to ``pos`` of a ``(num_choices, d)`` buffer (zeros elsewhere); backward is ``index_select``."""

    @staticmethod
    def forward(ctx, y_sorted, pos, num_choices):
        ctx.save_for_backward(pos)
        if pos.numel() == num_choices:  # nothing dropped: pos is a permutation; reading rows (index_select) is
            inv = torch.empty_like(pos).index_copy_(0, pos, torch.arange(num_choices, device=pos.device))
            return y_sorted.index_select(0, inv)                             # faster than writing them
        out = y_sorted.new_zeros((num_choices,) + tuple(y_sorted.shape[1:]))  # zero rows for dropped choices
        return out.index_copy_(0, pos, y_sorted)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return grad.index_select(0, pos), None, None


def scatter(x: torch.Tensor, pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert-contiguous input buffer ``(N, d)``: row ``i`` is the token of choice ``pos[i]``."""
    return MOEScatter.apply(x, torch.div(pos, top_k, rounding_mode="floor"))


def gather(y_sorted: torch.Tensor, pos: torch.Tensor, num_choices: int) -> torch.Tensor:
    """Put expert outputs back in token order: ``(T*k, d)``, zero rows for dropped choices."""
    return MOEGather.apply(y_sorted, pos, num_choices)


class MOECombine(torch.autograd.Function):
    """``y[t] = sum_j score[t, j] * y_choices[t*k + j]`` as ``k`` fused multiply-adds (fastmoe: one ``bmm``).

    Backward: ``grad_y_choices = score * grad`` (one broadcast multiply) and ``grad_score[t, j]`` = the dot of
    ``grad[t]`` with choice ``j``'s output. Written out by hand because autograd's version of the broadcast
    multiply-and-sum makes three ``(T, k, d)`` temporaries, and on CPU T tiny ``bmm``s are slower still.
    """

    @staticmethod
    def forward(ctx, y_choices, gate_score):
        T, k = gate_score.shape
        y = y_choices.reshape(T, k, y_choices.shape[-1])                     # (T, k, d)
        score = gate_score.to(y.dtype)
        out = y[:, 0] * score[:, :1]                                         # (T, d)
        for j in range(1, k):
            out.addcmul_(y[:, j], score[:, j:j + 1])
        ctx.save_for_backward(y, score)
        ctx.score_dtype = gate_score.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        y, score = ctx.saved_tensors                                         # (T, k, d), (T, k)
        grad = grad.unsqueeze(1)                                             # (T, 1, d)
        grad_y = grad_score = None
        if ctx.needs_input_grad[0]:
            grad_y = (grad * score.unsqueeze(-1)).reshape(-1, y.shape[-1])   # (T*k, d)
        if ctx.needs_input_grad[1]:
            grad_score = torch.linalg.vecdot(grad, y).to(ctx.score_dtype)    # (T, k)
        return grad_y, grad_score


def combine(y_choices: torch.Tensor, gate_score: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's ``k`` choices: ``(T*k, d)`` and ``(T, k)`` -> ``(T, d)``."""
    T, k = gate_score.shape
    if y_choices.shape[0] != T * k:
        raise ValueError(f"combine got {y_choices.shape[0]} rows of expert output for {T} tokens x top_k={k}")
    return MOECombine.apply(y_choices, gate_score)


class MOEGatherCombine(torch.autograd.Function):
    """``combine(gather(y_sorted, pos, T*k), gate_score)`` in one pass, without KEEPING a ``(T*k, d)`` buffer.

    Forward reads each token's ``k`` expert rows from the expert-sorted buffer (with nothing dropped it still
    makes one ``(T*k, d)`` ``index_select`` of them, freed when forward returns; it saves ``y_sorted``, which
    exists anyway, for backward). Backward gives each sorted row ``score * grad[its token]`` (one
    ``index_select`` and an in-place multiply) and each score the dot of ``grad[token]`` with its row. Against
    the two named steps: one ``(T*k, d)`` buffer fewer made per step (3 instead of 4 when the scores need a
    gradient), and none held from forward to backward instead of one (chapter 01 measures both).
    """

    @staticmethod
    def forward(ctx, y_sorted, pos, gate_score):
        T, k = gate_score.shape
        score = gate_score.to(y_sorted.dtype)                                # (T, k)
        if pos.numel() == T * k:   # nothing dropped: pos is a permutation, read rows through its inverse
            inv = torch.empty_like(pos).index_copy_(0, pos, torch.arange(T * k, device=pos.device))
            y = y_sorted.index_select(0, inv).view(T, k, y_sorted.shape[-1])  # (T, k, d)
            out = y[:, 0] * score[:, :1]                                     # (T, d)
            for j in range(1, k):
                out.addcmul_(y[:, j], score[:, j:j + 1])
        else:                      # dropped choices add nothing: weight the kept rows, add them per token
            weighted = y_sorted * score.reshape(-1).index_select(0, pos)[:, None]       # (N, d)
            out = y_sorted.new_zeros(T, y_sorted.shape[-1]).index_add_(0, pos // k, weighted)
        ctx.save_for_backward(y_sorted, pos, score)
        ctx.score_dtype = gate_score.dtype
        return out

    @staticmethod
    def backward(ctx, grad):                                                 # (T, d)
        y_sorted, pos, score = ctx.saved_tensors
        T, k = score.shape
        grad_rows = grad.index_select(0, torch.div(pos, k, rounding_mode="floor"))  # (N, d) grad of each row's token
        grad_score = None
        if ctx.needs_input_grad[2]:
            dots = torch.linalg.vecdot(grad_rows, y_sorted)                  # (N,)
            grad_score = dots.new_zeros(T * k).index_copy_(0, pos, dots).view(T, k).to(ctx.score_dtype)
        grad_y = grad_rows.mul_(score.reshape(-1).index_select(0, pos)[:, None]) if ctx.needs_input_grad[0] else None
        return grad_y, None, grad_score


def gather_combine(y_sorted: torch.Tensor, pos: torch.Tensor, gate_score: torch.Tensor) -> torch.Tensor:
    """``combine(gather(y_sorted, pos, T*k), gate_score)`` fused: ``(N, d)`` sorted rows -> ``(T, d)``."""
    T, k = gate_score.shape
    if pos.numel() != y_sorted.shape[0] or pos.numel() > T * k:
        raise ValueError(f"gather_combine got {y_sorted.shape[0]} rows for {pos.numel()} positions and "
                         f"{T} tokens x top_k={k}")
    return MOEGatherCombine.apply(y_sorted, pos, gate_score)


def check_gate_output(gate_idx, gate_score, num_tokens: int, top_k: int, tot_expert: int):
    """Validate a gate's output and return it as ``(T, k)`` int64 ids and ``(T, k)`` scores.

    fastmoe gates may return flat ``(T*k,)`` ids or ``(T, 1, k)`` scores; those are reshaped. Anything else
    raises a ValueError naming the gate output that is wrong.
    """
    want = (num_tokens, top_k)
    if not torch.is_tensor(gate_idx) or not torch.is_tensor(gate_score):
        raise ValueError("the gate must return two tensors (gate_top_k_idx, gate_score)")
    if gate_idx.numel() != num_tokens * top_k:
        raise ValueError(f"the gate returned gate_top_k_idx of shape {tuple(gate_idx.shape)}; expected {want} "
                         f"(T tokens, top_k choices)")
    if gate_score.numel() != num_tokens * top_k:
        raise ValueError(f"the gate returned gate_score of shape {tuple(gate_score.shape)}; expected {want}")
    check_expert_ids(gate_idx, tot_expert)
    if not gate_score.dtype.is_floating_point:
        raise ValueError(f"gate_score must be floating point, got dtype {gate_score.dtype}")
    return gate_idx.reshape(want).long(), gate_score.reshape(want)


def check_expert_ids(ids: torch.Tensor, tot_expert: int, name: str = "gate_top_k_idx",
                     dtype_error: type[Exception] = ValueError) -> None:
    """The lab's one expert-id check: integer ids, each ``-1`` (dropped) or ``0 .. tot_expert-1``.

    Raises ``dtype_error`` (ValueError for a gate's output; fastmoe's ``count_by_gate`` raises TypeError) for
    floating or bool ids and ValueError for ids out of range, naming ``name`` and the range found; and a
    ValueError when ``tot_expert`` (``num_expert * world_size``) is not an int >= 1: there is no expert."""
    if isinstance(tot_expert, bool) or not isinstance(tot_expert, numbers.Integral) or tot_expert < 1:
        raise ValueError(f"{name}: num_expert * world_size = {tot_expert!r}: there is no expert to route to; "
                         "num_expert and world_size must each be an int >= 1")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise dtype_error(f"{name} must hold integer expert ids, got dtype {ids.dtype}")
    if ids.numel():
        def error():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            return ValueError(f"{name} holds expert ids in [{lo}, {hi}]; expected -1 (dropped) or "
                              f"0..{tot_expert - 1} (num_expert * world_size - 1)")
        device_check((ids >= -1) & (ids < tot_expert), error,
                f"{name}: an expert id is outside -1..{tot_expert - 1} (num_expert * world_size - 1)")
