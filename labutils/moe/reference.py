"""Brute-force references: one token, one expert at a time. Slow on purpose. (Taught in chapter 01.)

Nothing here shares code with the fast path (no count_by_gate, no buffers, no MOELinear), so agreement
between the two is evidence that the dispatch is right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .transformer import _Expert


def expert_on_token(layer, e: int, x_t: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (a LOCAL index) of ``layer`` applied to one token ``x_t`` of shape ``(d,)``."""
    experts = layer.experts
    if isinstance(experts, _Expert):                        # one fused module holding every expert
        return _mlp_on_token(experts, e, x_t)
    expert = experts[e]
    if isinstance(expert, _Expert) and expert.htoh4.num_expert == 1:   # fastmoe >= 1.0.1: one module each
        return _mlp_on_token(expert, 0, x_t)
    row = x_t.unsqueeze(0)
    y = expert(row, torch.tensor([1])) if layer._expert_takes_count[e] else expert(row)
    return y.reshape(-1)


def _mlp_on_token(expert, i: int, x_t: torch.Tensor) -> torch.Tensor:
    h = F.linear(x_t, expert.htoh4.weight[i], expert.htoh4.bias[i])
    return F.linear(expert.activation(h), expert.h4toh.weight[i], expert.h4toh.bias[i])


def reference_moe(layer, x: torch.Tensor, gate_idx=None, gate_score=None) -> torch.Tensor:
    """``y[t] = sum_j gate_score[t, j] * expert_{gate_idx[t, j]}(x[t])``; ``-1`` (dropped) adds nothing.

    ``x`` may have any leading dims. When ``gate_idx``/``gate_score`` are not given, ``layer.gate`` is called
    (seed the RNG the same way as for the fast run when the gate is random). world_size 1 only.
    """
    xs = x.reshape(-1, x.shape[-1])                                           # (T, d)
    if gate_idx is None:
        gate_idx, gate_score = layer.gate(xs)
    if gate_score is None:
        raise ValueError("reference_moe: pass gate_idx and gate_score together (or neither, to call layer.gate)")
    k = -1 if xs.shape[0] else gate_idx.shape[-1]                            # no tokens: -1 would be ambiguous
    gate_idx = gate_idx.reshape(xs.shape[0], k)                              # (T, k)
    gate_score = gate_score.reshape(xs.shape[0], k)
    rows = []
    for t in range(xs.shape[0]):
        acc = xs.new_zeros(xs.shape[1])
        for j in range(gate_idx.shape[1]):
            e = int(gate_idx[t, j])
            if e >= 0:
                acc = acc + gate_score[t, j] * expert_on_token(layer, e, xs[t])
        rows.append(acc)
    out = torch.stack(rows) if rows else xs.new_zeros(0, xs.shape[1])
    return out.reshape(x.shape)


def reference_count_by_gate(gate_idx: torch.Tensor, tot_expert: int):
    """Python-loop ``count_by_gate``: positions (into the flattened ids) grouped by expert, and counts."""
    flat = gate_idx.reshape(-1).tolist()
    pos = [i for e in range(tot_expert) for i, g in enumerate(flat) if g == e]
    counts = [sum(1 for g in flat if g == e) for e in range(tot_expert)]
    return torch.tensor(pos, dtype=torch.long), torch.tensor(counts, dtype=torch.long)


def reference_limit_by_capacity(gate_idx: torch.Tensor, tot_expert: int, capacity: int) -> torch.Tensor:
    """Python-loop capacity: visit first choices token by token, then second choices; keep while room is left."""
    out = gate_idx.clone()
    load = [0] * tot_expert
    for j in range(gate_idx.shape[1]):
        for t in range(gate_idx.shape[0]):
            e = int(gate_idx[t, j])
            if e < 0:
                continue
            if load[e] < capacity:
                load[e] += 1
            else:
                out[t, j] = -1
    return out


def reference_topk_gate(logits: torch.Tensor, top_k: int):
    """Top-k by sorting each row, then softmax over the chosen logits (what NaiveGate computes)."""
    idx = torch.stack([torch.argsort(row, descending=True, stable=True)[:top_k] for row in logits])
    top = torch.gather(logits, 1, idx)
    return idx, torch.softmax(top, dim=-1)
