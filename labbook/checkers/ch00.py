"""Chapter 00's exercise cases for the grader (:mod:`labbook.grader`): gathering every rank's tensor with a
collective (run on every rank of sandboxes the grader starts, each rank's inputs drawn by the grader after the ranks
exist, from a generator no rank holds) and the parameter count of ``nn.Linear`` (integers, compared exactly).
Serves notebooks/00_setup.ipynb; red-teamed by tests/test_grader_ch00.py."""
from __future__ import annotations

import torch

from labbook.grader.answers import Cases

# --- exercise 1: gather_values(x) on every rank -----------------------------------------------------------


def gather_inputs(gen: torch.Generator, world: int, n: int, m: int) -> list:
    """Each rank's ``m`` inputs, ``(n,)`` int64 each: ``[rank][input]``, drawn by the grader for this case only."""
    return [[torch.randint(-10**6, 10**6, (n,), generator=gen) for _ in range(m)] for _ in range(world)]


def gather_reference(per_rank: list) -> list:
    """Every rank must hold every rank's input, in rank order: ``[rank][input]`` of ``(world, n)`` tensors."""
    world, m = len(per_rank), len(per_rank[0])
    stacked = [torch.stack([per_rank[r][j] for r in range(world)]) for j in range(m)]   # m x (world, n)
    return [[t.clone() for t in stacked] for _ in range(world)]


# a case's structure (world, n, inputs per rank), drawn before the ranks start; the inputs come after
STRUCTURE = {"gather_values": {"visible": [(3, 4, 2)], "n_hidden": 1,
                               "hidden": lambda rng, i: (rng.randint(2, 4), rng.randint(1, 5), 3)}}


# --- exercise 2: linear_params(d_in, d_out, bias) -----------------------------------------------------


def _linear_params_reference(d_in: int, d_out: int, bias: bool) -> int:
    """Counted entry by entry from the definition y = W x (+ b): W has d_out rows of d_in, b has d_out."""
    weights = sum(d_in for _ in range(d_out))
    return weights + (d_out if bias else 0)


def _linear_hidden(gen, i):
    d_in, d_out = (int(v) for v in torch.randint(1, 5000, (2,), generator=gen))
    return d_in, d_out, bool(torch.randint(0, 2, (1,), generator=gen))


CASES = {
    "gather_values": lambda: Cases(reference=gather_reference, inputs=gather_inputs),
    "linear_params": lambda: Cases(reference=_linear_params_reference,
                                   visible=[(3, 4, True), (1024, 4096, True), (7, 1, False)], hidden=_linear_hidden),
}
