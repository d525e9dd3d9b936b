"""Communication volume of expert parallelism: measured, minimal, and DeepSpeed's. (Taught in chapter 06.)

* ``record_traffic(model)`` collects what ``labutils.moe.expert_parallel.exchange_and_run`` really sent (rows
  per destination rank and bytes per row) for every call of ``model``'s MoE layers inside the ``with`` block:
  it adds a hook to each layer's ``exchange_hooks`` and removes it at the end (nothing global).
* ``token_matrix`` turns every rank's per-expert counts into the rank-to-rank token matrix.
* ``minimum_bytes``: rows routed to OTHER ranks x d x element size, what any exact exchange must send.
* ``deepspeed_bytes``: DeepSpeed's all-to-all sends the whole ``(E, C, d)`` capacity buffer, padded or not,
  whatever the routing; its ``C`` comes from :func:`labutils.ds.gating.ds_capacity`, the lab's one copy of
  DeepSpeed's formula (``deepspeed/moe/sharded_moe.py:_capacity``).

All byte counts are for ONE direction of one all-to-all (the dispatch); the return trip sends the same
again, and the backward repeats both.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["record_traffic", "TrafficLog", "token_matrix", "minimum_bytes", "deepspeed_capacity",
           "deepspeed_bytes", "deepspeed_dropped", "plot_token_matrix"]


@dataclass
class TrafficLog:
    """One entry per exchange: ``{"layer", "send_rows", "recv_rows", "row_bytes"}`` (rows per peer rank)."""
    calls: list = field(default_factory=list)

    def sent_bytes(self, rank: int, include_self: bool = False) -> int:
        """Bytes this rank's dispatch all-to-alls put on the wire (own rows excluded unless include_self)."""
        return sum(n * c["row_bytes"] for c in self.calls for peer, n in enumerate(c["send_rows"])
                   if include_self or peer != rank)


    def record(self, layer, send_rows, recv_rows, row_bytes: int) -> None:
        """The exchange hook: called by ``exchange_and_run`` after each dispatch all-to-all."""
        from .expert_parallel import layer_id

        self.calls.append({"layer": layer_id(layer), "send_rows": [int(n) for n in send_rows],
                           "recv_rows": [int(n) for n in recv_rows], "row_bytes": int(row_bytes)})


@contextmanager
def record_traffic(model: torch.nn.Module):
    """``with record_traffic(model) as log: model(x)`` records every expert-parallel exchange of ``model``'s
    MoE layers (``model`` may be one layer) in the block. Raises if ``model`` has no MoE layer."""
    layers = [m for m in model.modules() if hasattr(m, "run_experts")]
    if not layers:
        raise ValueError(f"record_traffic: {type(model).__name__} contains no MoE layer (FMoE) to record")
    log = TrafficLog()
    for layer in layers:
        layer.__dict__.setdefault("exchange_hooks", []).append(log.record)
    try:
        yield log
    finally:
        for layer in layers:
            layer.__dict__["exchange_hooks"].remove(log.record)


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
    """DeepSpeed's expert capacity ``C = max(ceil(tokens / E * capacity_factor * k), min_capacity)`` for the
    rank's LOCAL ``tokens``, as DeepSpeed computes it (float32: S=100, E=4, cf=1.2 gives 31, not 30).
    Calls :func:`labutils.ds.gating.ds_capacity`, the lab's one copy of the formula."""
    from ..ds.gating import ds_capacity

    return ds_capacity(tokens, num_experts, capacity_factor, k=top_k, min_capacity=min_capacity)


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
    from matplotlib.patches import Rectangle

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
        ax.add_patch(Rectangle((r - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="tab:orange", lw=1.5))
    ax.set_xlabel("destination rank (holds the expert)")
    ax.set_ylabel("source rank (holds the token)")
    ax.set_xticks(range(world))
    ax.set_yticks(range(world))
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig
