"""fastmoe's other gates, in plain PyTorch: ZeroGate and the worker-level balancing DCGate and SwipeGate.
(Taught in chapter 01.)

* :class:`ZeroGate` (``fmoe/gates/zero_gate.py``): every token to expert 0 (a baseline and a test fixture).
* :class:`DCGate` ("distributed capacity", ``fmoe/gates/dc_gate.py``): GShard's gate whose capacity is set from
  the GLOBAL load: each expert accepts ``ceil(factor * T)`` tokens from all workers together.
* :class:`SwipeGate` (``fmoe/gates/swipe_gate.py`` and its CUDA ``swipe_once``): in training, a worker that
  receives more choices than its capacity refuses the excess, and the refused choices are re-sent to workers
  that still have room. fastmoe runs this on the host with NCCL; here the same steps use ``torch.distributed``
  (two all-to-alls, an all-reduce and an all-gather of ``world_size`` numbers per choice column).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import require_process_group
from .capacity import exchange_counts, fastmoe_dc_capacity, limit_by_capacity, position_in_expert
from .capacity_gates import GShardGate
from .functions import check_top_k
from .gates import BaseGate, NaiveGate, check_gate_input


class ZeroGate(BaseGate):
    """fastmoe's ZeroGate: every token to global expert 0, ``top_k`` times, each with weight ``1/top_k``.

    No loss. Returns fastmoe's shapes: flat ``(T*k,)`` ids and ``(T, 1, k)`` scores. ``d_model`` only checks
    the input's shape (fastmoe ignores it).
    """

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2):
        super().__init__(num_expert, world_size)
        check_top_k(top_k, self.tot_expert)
        self.d_model = d_model
        self.top_k = top_k

    def forward(self, x):
        check_gate_input(self, x, self.d_model)
        T = x.shape[0]
        idx = torch.zeros(T * self.top_k, dtype=torch.int64, device=x.device)           # (T*k,)
        return idx, torch.full((T, 1, self.top_k), 1.0 / self.top_k, device=x.device)  # (T, 1, k)


class DCGate(GShardGate):
    """GShard's loss, top-2 and random routing, with capacity ``ceil(factor * T)`` per expert over ALL workers
    (:func:`~labutils.moe.capacity_gates.limit_by_capacity`, before random routing, as in fastmoe).
    ``group``: the process group of the ``world_size`` workers (default: the default group)."""

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 capacity=(1.2, 2.4), random_routing: bool = True, gate_bias: bool = True, topk=None, group=None):
        super().__init__(d_model, num_expert, world_size, top_k, capacity, random_routing, gate_bias, topk)
        self.group = group

    def capacity_formula(self, num_tokens: int, factor: float) -> int:
        return fastmoe_dc_capacity(num_tokens, factor)

    def apply_capacity(self, idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        cap = self.capacity_per_expert(num_tokens)
        return limit_by_capacity(idx, self.num_expert, world_size=self.world_size, capacity=cap, group=self.group)[2]


class SwipeGate(NaiveGate):
    """Top-k with worker-level load balancing (SWIPE). Eval: plain top-k. Training: for each choice column
    ``j``, :meth:`swipe_once` re-routes the choices over-loaded workers refuse, to expert ``j % num_expert``
    of a worker with room; the score is the softmax over the k (new) experts' logits. No balancing loss
    (as in fastmoe). With one worker nothing is ever refused (capacity ``T*k``), so it equals the naive gate.
    ``group``: the process group of the ``world_size`` workers (default: the default group)."""

    def __init__(self, d_model: int, num_expert: int, world_size: int = 1, top_k: int = 2,
                 gate_bias: bool = True, group=None):
        super().__init__(d_model, num_expert, world_size, top_k, gate_bias)
        self.group = group

    def swipe_once(self, idx: torch.Tensor, capacity, bias: int):
        """One SWIPE round. ``idx`` ``(T,)`` global expert ids; ``capacity`` (0-d int64) the choices this
        worker may still receive; ``bias`` the local expert that re-routed choices go to.
        Returns ``(new_idx (T,), new_capacity (0-d int64))``. Every rank of the group calls it."""
        W, ne = self.world_size, self.num_expert
        cap = int(capacity)
        with torch.no_grad():
            dest = torch.div(idx, ne, rounding_mode="floor")                     # (T,) destination worker
            lec = torch.bincount(dest, minlength=W)                              # (W,) my choices per worker
            gec = exchange_counts(lec, W, self.group).tolist()                   # [W] sent to me by each worker
            drop = [0] * W                                                       # refused, by source worker
            for i in range(W):                                                   # accept in rank order
                take = min(cap, gec[i])
                drop[i], gec[i], cap = gec[i] - take, take, cap - take
            lec = exchange_counts(torch.tensor(gec), W, self.group).tolist()     # [W] accepted of mine
            drop, gcap = self._share(drop, cap)                                  # totals; room left per worker
            me = dist.get_rank(self.group) if W > 1 else 0
            j = 0
            for i in range(W):                                                   # refused of worker i -> room of j
                while drop[i] > 0:
                    if j >= W:
                        raise RuntimeError(f"SwipeGate: {sum(drop)} refused choices but no capacity left on any "
                                           f"worker (the workers' batch sizes differ too much)")
                    moved = min(drop[i], gcap[j])
                    drop[i], gcap[j] = drop[i] - moved, gcap[j] - moved
                    if i == me:
                        lec[j] += moved
                    if j == me:
                        cap -= moved
                    if gcap[j] == 0 and drop[i] > 0:
                        j += 1
            quota = torch.tensor(lec, device=idx.device)                         # (W,) choices each worker takes
            keep = position_in_expert(dest[:, None], W)[:, 0] < quota[dest]      # first ones in token order
            room = quota - torch.bincount(dest[keep], minlength=W)               # re-routed slots per worker
            to = torch.repeat_interleave(torch.arange(W, device=idx.device), room)[: int((~keep).sum())]
            new = idx.clone()
            new[~keep] = to * ne + bias
        return new, torch.tensor(cap, dtype=torch.int64)

    def _share(self, drop: list, cap: int):
        """All-reduce the refused counts (per source worker) and all-gather every worker's remaining room."""
        if self.world_size == 1:
            return drop, [cap]
        require_process_group(self.group, self.world_size, "SwipeGate")
        drop_t = torch.tensor(drop)
        dist.all_reduce(drop_t, group=self.group)
        gcap = [torch.zeros((), dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(gcap, torch.tensor(cap), group=self.group)
        return drop_t.tolist(), [int(c) for c in gcap]

    def forward(self, x):
        if isinstance(self.gate, nn.Linear):
            check_gate_input(self, x, self.gate.in_features, self.gate.weight.dtype)
        logits = self.gate(x)                                                    # (T, E)
        top_val, top_idx = torch.topk(logits, k=self.top_k, dim=-1)              # (T, k)
        if not self.training:
            return top_idx, torch.softmax(top_val, dim=-1)
        capacity = torch.tensor(x.shape[0] * self.top_k, dtype=torch.int64)
        rows = torch.arange(x.shape[0], device=x.device)
        idxs, vals = [], []
        for j in range(self.top_k):
            idx, capacity = self.swipe_once(top_idx[:, j], capacity, j % self.num_expert)
            idxs.append(idx)
            vals.append(logits[rows, idx])
        return torch.stack(idxs, 1), torch.softmax(torch.stack(vals, 1), dim=-1)  # (T, k), (T, k)
