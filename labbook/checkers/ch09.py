"""Chapter 09's exercise cases for the grader (:mod:`labbook.grader`): the auxiliary-loss-free bias update
(torchtitan's mean-centred sign step) and expert-choice routing (each expert's top-C tokens, ties to the earlier
token). Serves notebooks/09_modern_moe.ipynb; red-teamed by tests/test_grader_ch09.py.

Both references are brute-force Python loops written from the definitions, not
``labutils.moe.modern.aux_free.bias_update`` or ``labutils.moe.modern.expert_choice.expert_choice_route`` (the
functions the exercises re-implement); they run in the grading parent, and the sandbox cannot import either."""
from __future__ import annotations

import torch

from labbook.grader.answers import Cases

# --- exercise 1: my_bias_update(bias, counts, rate) -------------------------------------------------------------


def _bias_reference(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """b + gamma sign(mean c - c), minus the mean of that step, expert by expert in Python. (E,) like ``bias``."""
    c = [float(v) for v in counts.tolist()]
    mean = sum(c) / len(c)
    step = [rate * ((mean > v) - (mean < v)) for v in c]                  # +rate underloaded, -rate overloaded
    centre = sum(step) / len(step)
    return torch.tensor([b + s - centre for b, s in zip(bias.tolist(), step)], dtype=bias.dtype)


BIAS_VISIBLE = (
    (torch.zeros(4), torch.tensor([10, 2, 2, 2]), 0.1),                  # one overloaded expert
    (torch.linspace(-1, 1, 6), torch.tensor([3, 3, 3, 3, 3, 3]), 0.01),  # balanced: nothing moves
    (torch.tensor([0.5, -0.25, 0.0, 0.125, -0.5]), torch.tensor([0, 7, 1, 9, 3]), 1e-3),
)


def _bias_hidden(gen: torch.Generator, i: int) -> tuple:
    E = int(torch.randint(2, 65, (1,), generator=gen))
    bias = torch.randn(E, generator=gen)
    top = int(torch.randint(1, 200, (1,), generator=gen))
    counts = torch.randint(0, top, (E,), generator=gen)
    if i % 3 == 0:                                   # every expert but two exactly at the mean: sign 0
        v = int(torch.randint(2, 50, (1,), generator=gen))
        counts = torch.full((E,), v)
        counts[0], counts[1] = v + 2, v - 2
    rate = float(10 ** -torch.randint(1, 5, (1,), generator=gen).item())
    return (bias, counts, rate)



# --- exercise 2: my_expert_choice(scores, capacity) ----------------------------------------------------------


def _expert_choice_reference(scores: torch.Tensor, capacity: int) -> tuple:
    """For each expert (column), its ``capacity`` best tokens, best first, ties to the earlier token: a sort by
    ``(-score, token)`` in Python. ``(token_idx (E, C) int64, gates (E, C))``."""
    T, E = scores.shape
    rows = scores.t().tolist()
    idx = [sorted(range(T), key=lambda t, r=r: (-r[t], t))[:capacity] for r in rows]
    idx_t = torch.tensor(idx, dtype=torch.int64).reshape(E, capacity)
    gates = torch.tensor([[rows[e][t] for t in idx[e]] for e in range(E)], dtype=scores.dtype).reshape(E, capacity)
    return idx_t, gates


_g = torch.Generator().manual_seed(0)
EC_VISIBLE = (
    (torch.softmax(torch.randn(12, 4, generator=_g), -1), 3),
    (torch.softmax(torch.randn(20, 5, generator=_g), -1), 8),
    (torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.9, 0.1]]), 2),             # ties: the earlier token first
)
del _g


def _ec_hidden(gen: torch.Generator, i: int) -> tuple:
    T = int(torch.randint(2, 48, (1,), generator=gen))
    E = int(torch.randint(1, 9, (1,), generator=gen))
    if i % 2:                                                            # many exact ties
        scores = torch.randint(0, 4, (T, E), generator=gen).float() / 4
    else:
        scores = torch.softmax(torch.randn(T, E, generator=gen) * 3, -1)
    capacity = int(torch.randint(1, T + 1, (1,), generator=gen))
    return (scores, capacity)


CASES = {
    "my_bias_update": lambda: Cases(_bias_reference, BIAS_VISIBLE, _bias_hidden, n_hidden=9),
    "my_expert_choice": lambda: Cases(_expert_choice_reference, EC_VISIBLE, _ec_hidden, n_hidden=10),
}
