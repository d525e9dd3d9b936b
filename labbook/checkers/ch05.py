"""Chapter 05's exercise cases for the grader (:mod:`labbook.grader`): the balance entropy of a routed-token count
table, and the step at which a validation curve first reaches a loss (linear between evaluations, None when it never
does). Serves notebooks/05_moe_vs_dense.ipynb; red-teamed by tests/test_grader_ch05.py.

The references are written here as plain Python loops over lists (not ``lm_study.steps_to_reach``, not
``train_modern.balance_stats``), and every case, visible or hidden, is built inside this module: nothing is read
from the notebook's globals (its ``record`` of the live run)."""
from __future__ import annotations

import math

import torch

from labbook.grader.answers import Cases

# --- exercise 1: balance_entropy(load) ------------------------------------------------------------------------


def _entropy_reference(load: torch.Tensor) -> float:
    """Entropy of the share of all routed tokens per expert, over log(E): a loop over Python numbers."""
    rows = load.tolist()
    experts = len(rows[0])
    totals = [sum(row[e] for row in rows) for e in range(experts)]
    grand = sum(totals)
    h = 0.0
    for t in totals:
        if t:
            p = t / grand
            h -= p * math.log(p)
    return h / math.log(experts)


ENTROPY_VISIBLE = (
    (torch.tensor([[5, 0, 0, 0]]),),                                  # one expert takes everything: 0
    (torch.tensor([[3, 3], [1, 1]]),),                                # balanced: 1
    (torch.tensor([[4, 0, 1], [0, 2, 1]]),),                          # rows differ: the TOTAL share counts
)


def _entropy_hidden(gen: torch.Generator, i: int) -> tuple:
    windows = int(torch.randint(1, 12, (1,), generator=gen))
    experts = int(torch.randint(2, 17, (1,), generator=gen))
    load = torch.randint(0, 50, (windows, experts), generator=gen)   # (windows, experts)
    if i % 3 == 0:
        load[:, torch.randperm(experts, generator=gen)[: experts // 2]] = 0  # dead experts: 0 log 0 = 0
    if i % 4 == 1:
        load[1:] = 0                                                 # all tokens in the first window
    load[0, int(torch.randint(experts, (1,), generator=gen))] += 1     # never an all-zero table
    return (load,)



# --- exercise 2: my_steps_to_reach(steps, losses, target) -----------------------------------------------------


def _reach_reference(steps: list, losses: list, target: float) -> tuple:
    """Walk the evaluations; at the first one at or below ``target`` solve its segment for the crossing.
    Returned as ``(reached, step)``: ``(1, step)``, or ``(0, 0.0)`` for "never" (None)."""
    for i in range(len(steps)):
        if losses[i] <= target:
            if i == 0:
                return 1, float(steps[0])
            frac = (losses[i - 1] - target) / (losses[i - 1] - losses[i])  # 0 at the previous point, 1 at this one
            return 1, steps[i - 1] * (1 - frac) + steps[i] * frac
    return 0, 0.0


def _as_pair(got, args) -> tuple:
    """The answer as ``(reached, step)``: None is ``(0, 0.0)``; a number ``x`` is ``(1, x)``."""
    if got is not None and not isinstance(got, (int, float, torch.Tensor)):
        raise AssertionError(f"returned a {type(got).__name__}: a step (a number) or None")
    return (0, 0.0) if got is None else (1, got)


REACH_VISIBLE = (
    ([100, 200, 300], [3.0, 2.0, 1.0], 1.5),                           # halfway between evaluations: 250
    ([10, 20], [1.0, 0.5], 2.0),                                      # already there at the first evaluation
    ([1, 2, 3], [3.0, 2.5, 2.6], 1.0),                                # never: None
    ([125, 250, 375], [2.1, 1.9, 1.95], 1.92),                        # not monotone; the FIRST crossing
    ([100, 200, 300], [3.0, 2.0, 1.0], 2.0),                          # exactly an evaluated loss: 200
    ([1, 2, 3], [3.0, 2.0, 2.5], 2.0),                                # touches the target, rises again: 2
)


def _reach_hidden(gen: torch.Generator, i: int) -> tuple:
    n = int(torch.randint(2, 12, (1,), generator=gen))
    gaps = torch.randint(1, 300, (n,), generator=gen)
    steps = gaps.cumsum(0).tolist()                                   # increasing, uneven spacing
    losses = (4.0 - torch.rand(n, generator=gen, dtype=torch.float64).cumsum(0) * 0.5
              + torch.randn(n, generator=gen, dtype=torch.float64) * 0.2).tolist()
    kind = i % 4
    if kind == 0:
        target = min(losses) - 0.1                                    # never reached
    elif kind == 1:  # exactly the loss of an evaluation that is the first to get that low: "at or below" counts
        lows = [j for j in range(n) if all(losses[j] < v for v in losses[:j])]
        target = losses[lows[int(torch.randint(len(lows), (1,), generator=gen))]]
    else:
        lo, hi = min(losses), max(losses)
        target = lo + float(torch.rand(1, generator=gen, dtype=torch.float64)) * (hi - lo)
    return (steps, losses, target)


CASES = {
    "balance_entropy": lambda: Cases(_entropy_reference, ENTROPY_VISIBLE, _entropy_hidden, n_hidden=10),
    "my_steps_to_reach": lambda: Cases(_reach_reference, REACH_VISIBLE, _reach_hidden, n_hidden=12, rtol=1e-9,
                                       atol=1e-9, reduce=_as_pair),
}
