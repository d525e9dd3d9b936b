"""Communication volume of expert parallelism: measured, minimal, and DeepSpeed's. (Taught in chapter 06.)

* ``record_traffic()`` collects what ``labutils.moe.parallel.exchange_and_run`` really sent (rows per
  destination rank and bytes per row) for every layer call inside the ``with`` block.
* ``token_matrix`` turns every rank's per-expert counts into the rank-to-rank token matrix.
* ``minimum_bytes``: rows routed to OTHER ranks x d x element size, what any exact exchange must send.
* ``deepspeed_bytes``: DeepSpeed's all-to-all sends the whole ``(E, C, d)`` capacity buffer, padded or not,
  whatever the routing; ``deepspeed_capacity`` re-derives its ``C`` (``deepspeed/moe/sharded_moe.py:_capacity``).

All byte counts are for ONE direction of one all-to-all (the dispatch); the return trip sends the same
again, and the backward repeats both.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["record_traffic", "record", "TrafficLog", "token_matrix", "minimum_bytes", "deepspeed_capacity",
           "deepspeed_bytes", "deepspeed_dropped", "plot_token_matrix"]


@dataclass
class TrafficLog:
    """One entry per exchange: ``{"layer", "send_rows", "recv_rows", "row_bytes"}`` (rows per peer rank)."""
    calls: list = field(default_factory=list)

    def sent_bytes(self, rank: int, include_self: bool = False) -> int:
        """Bytes this rank's dispatch all-to-alls put on the wire (own rows excluded unless include_self)."""
        return sum(n * c["row_bytes"] for c in self.calls for peer, n in enumerate(c["send_rows"])
                   if include_self or peer != rank)


_active: list = []


@contextmanager
def record_traffic():
    """``with record_traffic() as log: ...`` records every expert-parallel exchange in this process."""
    log = TrafficLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def record(layer_id: int, send_rows, recv_rows, row_bytes: int) -> None:
    """Called by ``exchange_and_run``; a no-op outside ``record_traffic()``."""
    for log in _active:
        log.calls.append({"layer": layer_id, "send_rows": [int(n) for n in send_rows],
                          "recv_rows": [int(n) for n in recv_rows], "row_bytes": int(row_bytes)})


def token_matrix(local_expert_counts, num_expert: int) -> torch.Tensor:
    """``(W, W)`` int64: entry ``[src, dst]`` = rows rank ``src`` sends to rank ``dst``.

    ``local_expert_counts``: ``(W, W*num_expert)``, row r = rank r's ``local_expert_count``.
    """
    counts = torch.as_tensor(local_expert_counts, dtype=torch.long)
    world = counts.shape[0]
    if counts.shape != (world, world * num_expert):
        raise ValueError(f"expected ({world}, {world * num_expert}) counts, got {tuple(counts.shape)}")
    return counts.view(world, world, num_expert).sum(-1)


def minimum_bytes(matrix: torch.Tensor, d_model: int, element_size: int) -> torch.Tensor:
    """``(W,)`` bytes each rank must send to other ranks: routed off-rank rows x d x element size."""
    off_rank = matrix.sum(1) - matrix.diagonal()
    return off_rank * d_model * element_size


def deepspeed_capacity(tokens: int, num_experts: int, capacity_factor: float, top_k: int = 1,
                       min_capacity: int = 4) -> int:
    """DeepSpeed's expert capacity ``C = max(ceil(tokens / E * capacity_factor * k), min_capacity)``
    (top-2 gating doubles the factor, top-k multiplies by k). ``tokens`` is the rank's LOCAL token count."""
    return max(math.ceil(tokens / num_experts * capacity_factor * top_k), min_capacity)


def deepspeed_bytes(tokens: int, num_experts: int, world: int, d_model: int, element_size: int,
                    capacity_factor: float, top_k: int = 1, min_capacity: int = 4) -> int:
    """Bytes one rank sends to OTHER ranks in DeepSpeed's dispatch all-to-all: its ``(E, C, d)`` buffer
    minus the ``E/W`` experts' slots that stay local, i.e. ``E*C*d*size*(W-1)/W``, independent of routing."""
    cap = deepspeed_capacity(tokens, num_experts, capacity_factor, top_k, min_capacity)
    return num_experts * cap * d_model * element_size * (world - 1) // world


def deepspeed_dropped(local_expert_counts, tokens: int, capacity_factor: float, top_k: int = 1,
                      min_capacity: int = 4) -> int:
    """Choices DeepSpeed would drop for this routing: rows over capacity, summed over ranks and experts."""
    counts = torch.as_tensor(local_expert_counts, dtype=torch.long)          # (W, E)
    cap = deepspeed_capacity(tokens, counts.shape[1], capacity_factor, top_k, min_capacity)
    return int((counts - cap).clamp_min(0).sum())


def plot_token_matrix(matrix: torch.Tensor, title: str = "rows sent, rank -> rank"):
    """Heatmap of the rank-to-rank token matrix, numbers in the cells, the (local) diagonal framed."""
    import matplotlib.pyplot as plt

    m = torch.as_tensor(matrix).cpu()
    world = m.shape[0]
    fig, ax = plt.subplots(figsize=(1.0 + 0.5 * world, 0.8 + 0.45 * world), dpi=100)
    im = ax.imshow(m.numpy(), cmap="Blues")
    for s in range(world):
        for t in range(world):
            v = int(m[s, t])
            ax.text(t, s, str(v), ha="center", va="center", fontsize=8,
                    color="white" if v > 0.6 * float(m.max()) else "black")
    for r in range(world):  # the diagonal stays on the rank: no network
        ax.add_patch(plt.Rectangle((r - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="tab:orange", lw=1.5))
    ax.set_xlabel("destination rank (holds the expert)")
    ax.set_ylabel("source rank (holds the token)")
    ax.set_xticks(range(world))
    ax.set_yticks(range(world))
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig
