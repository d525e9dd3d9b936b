"""Chapter 01's exercise cases for the grader (:mod:`labbook.grader`): a top-k MoE forward from plain tensors, the
Switch balancing loss, ``count_by_gate``, a top-k gate on logits, and capacity dropping. Serves
notebooks/01_fastmoe_core.ipynb; red-teamed by tests/test_grader_ch01.py.

Every reference here is a brute-force loop over tokens written for the grader, not the lab's ``labutils.moe`` code
the exercise re-implements; it runs in the grading parent only.
"""
from __future__ import annotations

import math

import torch

from labbook.grader.answers import Cases

# --- brute-force references ---------------------------------------------------------------------------------


def _gelu(v: float) -> float:
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def _best_first(row: list, k: int) -> list:
    """Indices of the k largest values of ``row``, largest first (a stable sort: the lower index wins a tie)."""
    return sorted(range(len(row)), key=lambda e: -row[e])[:k]


def _softmax(vals: list) -> list:
    top = max(vals)
    ex = [math.exp(v - top) for v in vals]
    return [v / sum(ex) for v in ex]


def moe_forward_reference(x, w_gate, b_gate, W1, b1, W2, b2, k):
    """Token by token, in float64 Python numbers: the top-k of the gate's logits (chosen on the float32 logits),
    the softmax over those k, then ``sum_j g_j * (W2[e] gelu(W1[e] x + b1[e]) + b2[e])``. ``(T, d)``."""
    logits32 = (x @ w_gate.T + b_gate).tolist()                              # (T, E) selection as in float32
    X, Wg, bg = x.double().tolist(), w_gate.double(), b_gate.double()
    out = []
    for t, row in enumerate(X):
        xt = torch.tensor(row, dtype=torch.float64)                          # (d,)
        chosen = _best_first(logits32[t], k)
        lg = [float(Wg[e] @ xt + bg[e]) for e in chosen]
        y = torch.zeros(len(row), dtype=torch.float64)
        for g, e in zip(_softmax(lg), chosen):
            hid = torch.tensor([_gelu(float(v)) for v in (W1[e].double() @ xt + b1[e].double())], dtype=torch.float64)
            y += g * (W2[e].double() @ hid + b2[e].double())
        out.append(y)
    return torch.stack(out) if out else torch.zeros(0, x.shape[1], dtype=torch.float64)


def switch_loss_reference(logits):
    """``E * sum_e f_e * P_e`` by counting: ``f_e`` share of tokens whose largest logit is ``e``, ``P_e`` mean
    softmax probability of ``e`` (float64). Zero tokens: 0."""
    rows = logits.double().tolist()
    T, E = len(rows), logits.shape[1]
    if T == 0:
        return torch.tensor(0.0, dtype=torch.float64)
    f, P = [0.0] * E, [0.0] * E
    for row in rows:
        f[_best_first(row, 1)[0]] += 1.0 / T
        for e, p in enumerate(_softmax(row)):
            P[e] += p / T
    return torch.tensor(E * sum(a * b for a, b in zip(f, P)), dtype=torch.float64)


def count_by_gate_reference(gate_idx, num_expert):
    """``pos``: flattened choice positions expert by expert, in token order within an expert; ``counts`` (E,)."""
    flat = gate_idx.reshape(-1).tolist()
    pos = [i for e in range(num_expert) for i, v in enumerate(flat) if v == e]
    return torch.tensor(pos, dtype=torch.int64), torch.tensor([flat.count(e) for e in range(num_expert)])


def topk_gate_reference(logits, k):
    """``(idx (T, k) best first, score (T, k) softmax over the k chosen logits)``, row by row."""
    idx, score = [], []
    for row in logits.tolist():                                              # float32 values, exact in float
        chosen = _best_first(row, k)
        idx.append(chosen)
        score.append(_softmax([row[e] for e in chosen]))
    return (torch.tensor(idx, dtype=torch.int64).reshape(-1, k),
            torch.tensor(score, dtype=torch.float64).reshape(-1, k))


def drop_reference(gate_idx, num_expert, capacity):
    """Keep a choice while its expert has room, all first choices in token order, then all second choices..."""
    out = gate_idx.tolist()
    load = [0] * num_expert
    for j in range(gate_idx.shape[1]):
        for t in range(gate_idx.shape[0]):
            e = out[t][j]
            if e < 0:
                continue
            if load[e] < capacity:
                load[e] += 1
            else:
                out[t][j] = -1
    return torch.tensor(out, dtype=torch.int64).reshape(gate_idx.shape)


# --- cases ------------------------------------------------------------------------------------------------


def moe_case(gen, T, d, h, E, k):
    """Random plain-tensor weights in fastmoe's init scale: ``(x, w_gate, b_gate, W1, b1, W2, b2, k)``."""
    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    return (r(T, d), r(E, d, scale=d ** -0.5), r(E, scale=0.1), r(E, h, d, scale=d ** -0.5), r(E, h, scale=0.1),
            r(E, d, h, scale=h ** -0.5), r(E, d, scale=0.1), k)


def moe_visible():
    gen = torch.Generator().manual_seed(7)
    return [moe_case(gen, *shape) for shape in [(12, 8, 16, 4, 2), (7, 6, 10, 5, 1), (20, 8, 12, 6, 3)]]


def _moe_hidden(gen, i):
    E = int(torch.randint(2, 9, (1,), generator=gen))
    k = int(torch.randint(1, min(E, 3) + 1, (1,), generator=gen))
    T, d, h = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in [(1, 25), (2, 11), (2, 13)])
    return moe_case(gen, T, d, h, E, k)



def switch_visible():
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(16, 4, generator=gen),), (torch.randn(9, 8, generator=gen) * 3,),
            (torch.randn(1, 3, generator=gen),)]


def _switch_hidden(gen, i):
    T, E = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(2, 17, (1,), generator=gen))
    return (torch.randn(T, E, generator=gen) * float(torch.rand(1, generator=gen) * 4 + 0.1),)



def count_visible():
    gen = torch.Generator().manual_seed(4)
    return [(torch.randint(0, 4, (10, 2), generator=gen), 4), (torch.randint(-1, 6, (33, 2), generator=gen), 6),
            (torch.randint(-1, 3, (7, 1), generator=gen), 3), (torch.zeros(0, 2, dtype=torch.long), 5)]


def _count_hidden(gen, i):
    E = int(torch.randint(1, 9, (1,), generator=gen))
    T, k = int(torch.randint(0, 40, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
    return torch.randint(-1, E, (T, k), generator=gen), E



def topk_visible():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 8, generator=gen), 2), (torch.randn(5, 4, generator=gen), 1),
            (torch.randn(9, 6, generator=gen), 3)]


def _topk_hidden(gen, i):
    E = int(torch.randint(2, 17, (1,), generator=gen))
    T, k = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, min(E, 4) + 1, (1,), generator=gen))
    return torch.randn(T, E, generator=gen) * 2, k



def drop_visible():
    gen = torch.Generator().manual_seed(6)
    return [(torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0], [0, 1]]), 3, 2),   # token order != priority order
            (torch.randint(0, 4, (16, 2), generator=gen), 4, 5), (torch.randint(-1, 3, (20, 2), generator=gen), 3, 4),
            (torch.randint(0, 5, (9, 1), generator=gen), 5, 1)]


def _drop_hidden(gen, i):
    E = int(torch.randint(1, 7, (1,), generator=gen))
    T, k = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, min(E, 3) + 1, (1,), generator=gen))
    return torch.randint(-1, E, (T, k), generator=gen), E, int(torch.randint(0, 8, (1,), generator=gen))


CASES = {
    "my_moe_forward": lambda: Cases(moe_forward_reference, moe_visible(), _moe_hidden, rtol=1e-4, atol=1e-5),
    "my_switch_loss": lambda: Cases(switch_loss_reference, switch_visible(), _switch_hidden),
    "my_count_by_gate": lambda: Cases(count_by_gate_reference, count_visible(), _count_hidden),
    "my_topk_gate": lambda: Cases(topk_gate_reference, topk_visible(), _topk_hidden),
    "my_drop_over_capacity": lambda: Cases(drop_reference, drop_visible(), _drop_hidden),
}
