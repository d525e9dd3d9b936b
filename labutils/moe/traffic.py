"""Communication volume of expert parallelism: counted on the wire, minimal, and DeepSpeed's. (Taught in
chapter 06.)

* ``wire_bytes_of_call(layer, x)`` (inside a rank) counts with :mod:`labutils.wire` the TCP bytes one forward
  call of ``layer`` puts on the wire, the same call with no rows (the fixed cost: agreement, counts, framing)
  and the control collectives the design allows, run by hand; ``check_wire`` requires the fixed cost to be
  those collectives and the difference to be the routed rows, exactly. This is the one count here that is
  observed, not derived: an extra exchange anybody makes shows up in it.
* ``record_traffic(model)`` collects what ``labutils.moe.expert_parallel.exchange_and_run`` says it sent (rows
  per destination rank and bytes per row): bookkeeping from the same counts as the routing, not a measurement.
* ``token_matrix`` turns every rank's per-expert counts into the rank-to-rank token matrix.
* Two minimums under top-k: ``minimum_bytes`` (one row per (token, remote expert) choice, what FastMoE's
  exchange sends) and ``dedup_minimum_bytes`` (one row per (token, remote RANK): a token whose two experts
  sit on the same rank crosses once, as a deduplicating exchange such as DeepEP's inter-node dispatch does).
* ``deepspeed_bytes``: with ``drop_tokens=True`` DeepSpeed's all-to-all sends the whole ``(E, C, d)``
  capacity buffer, padded or not, whatever the routing (``C``: ``capacity.deepspeed_capacity``, imported here);
  with ``drop_tokens=False`` ``C`` is ``capacity.deepspeed_dropless_capacity``, the largest per-expert count
  all-reduced with MAX over the expert-parallel group, so the bytes follow the routing.

The minimums and DeepSpeed's bytes are for ONE direction of one all-to-all (the dispatch); the return trip
sends the same again (the wire count covers both), and the backward repeats both.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .._deprecate import forward_moved
from .capacity import deepspeed_capacity

__all__ = ["record_traffic", "TrafficLog", "token_matrix", "minimum_bytes", "dedup_minimum_bytes",
           "deepspeed_bytes", "deepspeed_dropped",
           "capacity_use", "plot_capacity_use", "plot_token_matrix", "wire_bytes_of_call", "wire_payload",
           "check_wire"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)


@dataclass
class TrafficLog:
    """One entry per exchange: ``{"layer", "send_rows", "recv_rows", "row_bytes"}`` (rows per peer rank)."""
    calls: list = field(default_factory=list)

    def sent_bytes(self, rank: int, include_self: bool = False) -> int:
        """Bytes this rank's dispatch all-to-alls were recorded sending (own rows excluded unless include_self):
        bookkeeping from the exchange's split sizes; :func:`wire_bytes_of_call` counts the wire itself."""
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
    """``(W,)`` bytes each rank sends to other ranks when every (token, expert) choice is one row (FastMoE's
    exchange): routed off-rank rows x d x element size."""
    off_rank = matrix.sum(1) - matrix.diagonal()
    return off_rank * d_model * element_size


def dedup_minimum_bytes(gate_idx_per_rank, num_expert: int, d_model: int, element_size: int) -> torch.Tensor:
    """``(W,)`` bytes each rank sends to other ranks when a token crosses to each remote RANK once, however
    many of its k experts live there (a deduplicating exchange). ``gate_idx_per_rank[r]``: rank r's ``(T_r, k)``
    global expert ids (``-1`` = not routed)."""
    world = len(gate_idx_per_rank)
    out = torch.zeros(world, dtype=torch.long)
    for r, idx in enumerate(gate_idx_per_rank):
        idx = torch.as_tensor(idx, dtype=torch.long).reshape(len(idx), -1)    # (T_r, k)
        for row in idx.tolist():
            out[r] += len({g // num_expert for g in row if g >= 0} - {r})
    return out * d_model * element_size


def capacity_use(local_expert_counts, capacity: int) -> dict:
    """Per global expert, over all source ranks, with ``capacity`` slots per (rank, expert):
    ``{"routed", "kept", "dropped", "padding"}`` as ``(E,)`` int64 tensors; ``routed = kept + dropped`` and
    ``kept + padding = W * capacity``."""
    counts = torch.as_tensor(local_expert_counts, dtype=torch.long)          # (W, E)
    kept = counts.clamp_max(capacity)
    return {"routed": counts.sum(0), "kept": kept.sum(0), "dropped": (counts - kept).sum(0),
            "padding": (capacity - kept).sum(0)}


def deepspeed_bytes(tokens: int, num_experts: int, world: int, d_model: int, element_size: int,
                    capacity_factor: float, top_k: int = 1, min_capacity: int = 4) -> int:
    """Bytes one rank sends to OTHER ranks in DeepSpeed's dispatch all-to-all: its ``(E, C, d)`` buffer
    minus the ``E/W`` experts' slots that stay local, i.e. ``E*C*d*size*(W-1)/W``, independent of routing.
    ``min_capacity`` defaults to the ``MoE`` layer's 4 (:func:`deepspeed_capacity` itself defaults to 0)."""
    cap = deepspeed_capacity(tokens, num_experts, capacity_factor, top_k, min_capacity)
    return num_experts * cap * d_model * element_size * (world - 1) // world


def deepspeed_dropped(local_expert_counts, tokens: int, capacity_factor: float, top_k: int = 1,
                      min_capacity: int = 4) -> int:
    """Choices DeepSpeed would drop for this routing: rows over capacity, summed over ranks and experts."""
    counts = torch.as_tensor(local_expert_counts, dtype=torch.long)          # (W, E)
    cap = deepspeed_capacity(tokens, counts.shape[1], capacity_factor, top_k, min_capacity)
    return int((counts - cap).clamp_min(0).sum())


def plot_capacity_use(local_expert_counts, capacities: dict, num_expert: int):
    """One panel per ``{label: C}``: rows each global expert receives (kept), the overflow DeepSpeed drops and
    the padded slots it ships anyway, against the ``W * C`` slots of its buffer; experts grouped by rank."""
    import matplotlib.pyplot as plt

    counts = torch.as_tensor(local_expert_counts, dtype=torch.long)          # (W, E)
    world, experts = counts.shape
    fig, axes = plt.subplots(1, len(capacities), figsize=(3.3 * len(capacities), 2.9), dpi=100, sharey=True,
                             squeeze=False)
    x = torch.arange(experts)
    top = 1.15 * max(int(counts.sum(0).max()), world * max(capacities.values()))
    for ax, (label, cap) in zip(axes[0], capacities.items()):
        use = capacity_use(counts, cap)
        ax.bar(x, use["kept"], color="tab:blue", label="kept")
        ax.bar(x, use["padding"], bottom=use["kept"], color="lightgrey", label="padding (sent, empty)")
        ax.bar(x, use["dropped"], bottom=use["kept"] + use["padding"], color="tab:red", label="dropped")
        ax.axhline(world * cap, color="black", lw=1, ls="--")
        ax.set_title(f"{label}: C={cap}, {int(use['dropped'].sum())} dropped,\n"
                     f"{int(use['padding'].sum())} padded slots", fontsize=8)
        for r in range(1, experts // num_expert):
            ax.axvline(r * num_expert - 0.5, color="tab:orange", lw=0.5)
        ax.set_xlabel("global expert (orange: rank boundary)", fontsize=8)
        ax.set_ylim(0, top)
    axes[0][0].set_ylabel(f"rows (dashed: W*C = {world}*C slots)", fontsize=8)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    return fig


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


# ---- on the wire -------------------------------------------------------------------------------------
def _control_collectives(world: int, num_expert: int, d_model: int, dtype, group) -> None:
    """What the exchange may send besides rows, done by hand with the same shapes: the checked counts all-to-all
    (``W * (9 + COUNT_SLOTS)`` int64: fingerprint and counts, ``expert_parallel.check_agreement_and_exchange_counts``),
    the bare counts all-to-all (``W*E`` int64) only when ``E`` exceeds ``COUNT_SLOTS``, and the dispatch and
    return all-to-alls with no rows."""
    import torch.distributed as dist

    from .expert_parallel import _FIELDS, COUNT_SLOTS

    checked = torch.zeros(world * (len(_FIELDS) + COUNT_SLOTS), dtype=torch.long)
    dist.all_to_all_single(torch.empty_like(checked), checked, group=group)
    if num_expert > COUNT_SLOTS:
        counts = torch.zeros(world * num_expert, dtype=torch.long)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
    rows = torch.zeros(0, d_model, dtype=dtype)
    for _ in range(2):
        dist.all_to_all_single(torch.empty_like(rows), rows, [0] * world, [0] * world, group=group)


def wire_bytes_of_call(layer, x: torch.Tensor, repeats: int = 5) -> dict:
    """Inside a rank (every rank calls it): TCP bytes this rank sends during one forward call of ``layer`` on
    ``x`` (``"call"``), on ``x[:0]`` (``"fixed"``: the same collectives with no rows), and during the
    control collectives the design allows, done by hand with the same shapes (``"control"``: the checked
    counts all-to-all, two row all-to-alls with no rows). Each is the smallest of ``repeats``
    counts (a stray message of another thread, e.g. the store's, can only add bytes).
    Runs under ``torch.no_grad``; barriers separate the counts. See :mod:`labutils.wire`."""
    import torch.distributed as dist

    from ..wire import count_wire

    if int(repeats) < 1:
        raise ValueError(f"wire_bytes_of_call: repeats must be >= 1, got {repeats!r}")
    group = getattr(layer, "moe_group", None)
    world = dist.get_world_size(group)
    runs = {"control": lambda: _control_collectives(world, int(layer.num_expert), x.shape[-1], x.dtype, group),
            "fixed": lambda: layer(x[:0]), "call": lambda: layer(x)}
    counted = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(int(repeats)):
            for name, run in runs.items():
                dist.barrier(group=group)
                with count_wire() as w:
                    run()
                    dist.barrier(group=group)                                 # every peer's rows have left
                counted[name].append(w.sent)
    return {name: min(v) for name, v in counted.items()}


def wire_payload(matrix: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``(W,)`` bytes each rank must send in one forward exchange, dispatch and return: its rows to other
    ranks' experts, then the results of other ranks' rows its experts computed."""
    m = torch.as_tensor(matrix, dtype=torch.long)
    off = m - torch.diag(m.diagonal())
    return (off.sum(1) + off.sum(0)) * int(row_bytes)


def check_wire(wire: list, matrix: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Raise AssertionError unless, on every rank, (1) the call with no rows sent exactly what the allowed
    control collectives send by hand, and (2) the call with rows sent exactly the routed rows of
    :func:`wire_payload` more. ``wire[r]``: rank r's :func:`wire_bytes_of_call`. Returns the ``(W,)`` bytes
    counted beyond the fixed cost."""
    want = wire_payload(matrix, row_bytes)
    if len(wire) != want.numel():
        raise ValueError(f"check_wire: {len(wire)} ranks' counts for a {tuple(want.shape)} routing")
    got = torch.tensor([int(w["call"]) - int(w["fixed"]) for w in wire], dtype=torch.long)
    bad = [f"rank {r}: the call with no rows sent {int(w['fixed']):,} B, the allowed control collectives "
           f"{int(w['control']):,} B ({int(w['fixed']) - int(w['control']):+,} B)"
           for r, w in enumerate(wire) if int(w["fixed"]) != int(w["control"])]
    bad += [f"rank {r}: {int(g):,} B beyond the fixed cost, the routed rows need {int(n):,} B ({int(g - n):+,} B)"
            for r, (g, n) in enumerate(zip(got, want)) if g != n]
    if bad:
        raise AssertionError("the exchange put other bytes on the wire than the routed rows and its control "
                             "messages:\n  " + "\n  ".join(bad))
    return got
