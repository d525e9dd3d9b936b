"""The one token dispatcher: sort/count -> scatter -> experts (here or across ranks) -> gather/combine.
(Taught in chapter 01; its transports in chapter 06, its backends in chapter 08.)

Every MoE layer of the lab routes first (a gate or router gives ``(T, k)`` expert ids and scores) and then hands
the rest to :func:`dispatch`: ``FMoE`` (and so ``FMoETransformerMLP``), ``ModernMoE`` and chapter 07's
``TinyMoE``. It is built from the core's named steps (``functions.py``):

    count_by_gate   expert ids (T, k), -1 dropped  ->  pos (N,) the choices sorted by expert, counts (E,)
    scatter         x (T, d)                       ->  x_sorted (N, d), expert-contiguous
    experts         x_sorted, counts               ->  y_sorted (N, d): the transport moves rows to the experts
    gather_combine  y_sorted, pos, scores (T, k)   ->  y (T, d) = sum over each token's choices of score * row

Two transports move the sorted rows to the experts and back: :func:`local` (all experts here) and
:class:`ExpertParallel` (fastmoe's all-to-all, ``expert_parallel.exchange_and_run``). Two expert backends run
them (``backends.py``, chosen by the machine): a loop of one matmul per expert (the CPU's fastest at the book's
sizes, ``expert_mlp.py``) and one grouped GEMM per linear (``torch._grouped_mm``). On the grouped backend a
local layer runs on the *device path* (``device_path.py``): counts stay on the device, from the gate to the
gradients, and no value is read by the host.
"""
from __future__ import annotations

from typing import Callable

import torch

from .device_path import on_device_path
from .functions import combine, count_by_gate, gather, gather_combine, scatter


# ---- transports: x_sorted (N, d), counts (W*E,), run(x, counts_of_my_experts) -> y_sorted (N, d) ----------
def local(x_sorted: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
    """Every expert is on this rank: run them on the sorted rows."""
    return run(x_sorted, counts)


class ExpertParallel:
    """The all-to-all transport (chapter 06): rows go to the rank holding their expert and come back.
    ``layer`` needs ``num_expert`` (experts per rank) and ``moe_group`` (see ``exchange_and_run``)."""

    def __init__(self, layer, check: bool = True):
        self.layer, self.check = layer, check

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        from .expert_parallel import exchange_and_run
        return exchange_and_run(self.layer, x_sorted, counts, check=self.check, run=run)


def with_sink(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``counts`` with the last expert's raised so they sum to ``rows``: it also runs the dropped rows at the end
    (no host read). ``torch._grouped_mm`` leaves rows past the last group unwritten; this leaves none."""
    last = torch.zeros_like(counts).index_fill_(0, torch.tensor([counts.numel() - 1], device=counts.device), 1)
    return counts + last * (rows - counts.sum())


# ---- the dispatcher ------------------------------------------------------------------------------------------
def dispatch(xs: list, gate_idx: torch.Tensor, gate_score: torch.Tensor, experts: Callable, *, num_expert: int,
             world_size: int = 1, score_before_experts: bool = False, fill: Callable | None = None) -> list:
    """Route the leaves ``xs`` (each ``(T, d)``, one routing for all) through ``experts``; returns each ``(T, d')``.

    * ``gate_idx`` ``(T, k)`` global expert ids, ``-1`` for a dropped choice; ``gate_score`` ``(T, k)``.
    * ``experts(x_sorted_leaves, counts)``: a transport and the experts, e.g.
      ``lambda xs, c: [local(xs[0], c, layer.run_experts)]``; ``counts`` ``(world_size * num_expert,)``.
    * ``score_before_experts``: weight each row by its score before the experts (``E(w x)``), not after.
    * ``fill(rows (T*k, d')) -> (T*k, d')``: gather, let ``fill`` change rows, then combine (fastmoe's masked
      rows, ``mask.py``); ``gate_score`` may then have more tokens than ``gate_idx`` (the masked ones).

    On the device path (:func:`~labutils.moe.device_path.on_device_path`, one rank) nothing is read by the host:
    dropped choices stay at the end of the sorted rows, where the last expert computes them along with its own
    (its count is raised to cover them, so every row the experts return is a real number), and their outputs
    are set to zero before the combine, so they add nothing forward and pass no gradient back.
    """
    device = on_device_path()
    k = gate_idx.shape[1]
    pos, counts = count_by_gate(gate_idx, num_expert, world_size, keep_dropped=device)  # (N,), (W*E,)
    x_sorted = [scatter(x, pos, k) for x in xs]                              # each (N, d) expert-contiguous
    score = gate_score
    if score_before_experts:                                                 # E(w x): weight rows, combine with 1
        w = gate_score.reshape(-1).index_select(0, pos)[:, None]             # (N, 1)
        x_sorted = [x * w.to(x.dtype) for x in x_sorted]
        score = torch.ones_like(gate_score)
    if not device:
        y_sorted = experts(x_sorted, counts)                                 # each (N, d')
    else:       # the last expert also runs the dropped rows at the end; their outputs are then zeroed
        served = torch.arange(pos.numel(), device=pos.device) < counts.sum()  # (N,)
        y_sorted = experts(x_sorted, with_sink(counts, pos.numel()))        # counts now sum to N
        y_sorted = [torch.where(served[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
                    for y in y_sorted]
    if fill is None:
        return [gather_combine(y, pos, score) for y in y_sorted]             # each (T, d')
    return [combine(fill(gather(y, pos, gate_idx.numel())), score) for y in y_sorted]
