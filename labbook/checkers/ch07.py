"""Chapter 07's exercise checkers: a rank's share of a batch along any dimension (uneven splits included, integers
compared exactly) and the grouped gradient reduction simulated on one process, each against a brute-force reference
written here, with hidden cases from a seed the student does not see. Serves notebooks/07_data_parallel.ipynb;
red-teamed by tests/test_exercise_cheats_ch07.py."""
from __future__ import annotations

import torch

from labbook.exercises import check_exercise

# --- exercise 1: shard_batch(x, rank, world, dim) ----------------------------------------------------------------

# torch ops that implement the uneven-split rule themselves (``x.chunk``, ``x.tensor_split``, ``torch.hsplit`` ...)
SPLIT_OPS = frozenset({"chunk", "unsafe_chunk", "tensor_split", "hsplit", "vsplit", "dsplit"})


def _numpy_splitters() -> list:
    """numpy's ``array_split``/``split`` (the same rule as ``tensor_split``), unwrapped to their Python code."""
    try:
        import numpy as np
    except ImportError:  # numpy is optional here
        return []
    return [getattr(f, "__wrapped__", f) for f in (np.array_split, np.split)]


def _shard_reference(x: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """Deal the rows out one at a time, row i to rank i % world, to count each rank's share; then rank r takes the
    next ``count[r]`` rows in order, after the shares of ranks 0..r-1 (contiguous, nothing dropped or repeated)."""
    n = x.shape[dim]
    count = [0] * world
    for i in range(n):
        count[i % world] += 1
    start = 0
    for r in range(rank):
        start += count[r]
    index = torch.tensor(list(range(start, start + count[rank])), dtype=torch.long)
    return x.index_select(dim, index)


def _shard_hidden(gen: torch.Generator, i: int):
    """A random tensor of 1 to 3 dims, a random dim, world 1..6, any rank; even i: the rows do not split equally."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    world = draw(2, 7) if i % 2 == 0 else draw(1, 7)
    ndim = draw(1, 4)
    dim = draw(0, ndim)
    n = draw(0, 4 * world + 1)
    if i % 2 == 0 and n % world == 0:
        n += draw(1, world)  # an uneven split
    shape = [draw(1, 4) for _ in range(ndim)]
    shape[dim] = n
    x = (torch.randint(-1000, 1000, shape, generator=gen) if i % 4 < 2
         else torch.randn(shape, generator=gen))
    return x, draw(0, world), world, dim


def check_shard_batch(fn, seed: int | None = None) -> None:
    """``fn(x, rank, world, dim)`` -> rank ``rank``'s contiguous share of ``x`` along ``dim`` under
    ``torch.tensor_split``'s rule: with ``n = x.shape[dim]``, the first ``n % world`` ranks get ``n // world + 1``
    rows, the others ``n // world`` (possibly 0); every row lands on exactly one rank, in order. 6 visible cases
    (including 7 rows over 2 ranks, 5 over 4, 2 over 3) and 10 hidden ones; splitting ops that implement the rule
    (``chunk``, ``tensor_split``, ``hsplit``/``vsplit``/``dsplit``, numpy's ``array_split``) and calls into labutils,
    DeepSpeed or fastmoe are refused."""
    g = torch.Generator().manual_seed(7)
    cases = [(torch.randint(-99, 99, (8, 3), generator=g), 1, 2, 0),       # even: 4 + 4
             (torch.randint(-99, 99, (7, 2), generator=g), 1, 2, 0),       # 4 + 3: rows 4..6
             (torch.randint(-99, 99, (5, 3), generator=g), 3, 4, 0),       # 2 + 1 + 1 + 1: row 4
             (torch.randn(3, 10, generator=g), 2, 3, 1),                   # 4 + 3 + 3 along dim 1
             (torch.randint(-99, 99, (2, 4, 2), generator=g), 2, 3, 0),    # 1 + 1 + 0: rank 2 gets no rows
             (torch.randn(2, 4, 6, generator=g), 0, 4, 2)]                 # 2 + 2 + 1 + 1 along dim 2
    check_exercise("shard_batch", fn, _shard_reference, *cases, hidden=_shard_hidden, n_hidden=10, seed=seed,
                   rtol=0.0, atol=0.0, ops=SPLIT_OPS, forbidden=_numpy_splitters())


# --- exercise 2: grouped_reduce(per_rank, is_expert, ep_size) ----------------------------------------------------


def _grouped_reference(per_rank: torch.Tensor, is_expert: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Entry by entry in float64: dense column p of rank r = mean over all ranks; expert column = sum over the ranks
    q with q % ep_size == r % ep_size (the replicas of r's experts), divided by the world size (DeepSpeed's
    scale)."""
    world, n_params = per_rank.shape
    out = torch.empty(world, n_params, dtype=torch.float64)
    for r in range(world):
        for p in range(n_params):
            if bool(is_expert[p]):
                total = sum(float(per_rank[q, p]) for q in range(world) if q % ep_size == r % ep_size)
            else:
                total = sum(float(per_rank[q, p]) for q in range(world))
            out[r, p] = total / world
    return out.to(per_rank.dtype)


def _grouped_hidden(gen: torch.Generator, i: int):
    """W in {2, 3, 4, 6, 8}, ep_size any divisor of W (1 and W included), 1 to 9 parameters, a random mask."""
    world = [2, 3, 4, 6, 8][int(torch.randint(0, 5, (1,), generator=gen))]
    divisors = [e for e in range(1, world + 1) if world % e == 0]
    ep_size = divisors[int(torch.randint(0, len(divisors), (1,), generator=gen))]
    n_params = int(torch.randint(1, 10, (1,), generator=gen))
    per_rank = torch.randn(world, n_params, generator=gen) * 10 ** float(torch.randint(-3, 4, (1,), generator=gen))
    return per_rank, torch.rand(n_params, generator=gen) < 0.5, ep_size


def check_grouped_reduce(fn, seed: int | None = None) -> None:
    """``fn(per_rank, is_expert, ep_size)`` -> the ``(W, P)`` gradients after the grouped reduction (see
    :func:`_grouped_reference`). 4 visible cases and 10 hidden ones; calls into labutils (its data_parallel module),
    DeepSpeed or fastmoe are refused."""
    g = torch.Generator().manual_seed(7)
    cases = [(torch.randn(2, 5, generator=g), torch.tensor([0, 1, 1, 0, 0]).bool(), 2),
             (torch.randn(4, 6, generator=g), torch.tensor([1, 0, 1, 0, 1, 0]).bool(), 2),
             (torch.randn(4, 3, generator=g), torch.tensor([1, 1, 0]).bool(), 1),
             (torch.randn(6, 4, generator=g), torch.tensor([1, 0, 0, 1]).bool(), 3)]
    check_exercise("grouped_reduce", fn, _grouped_reference, *cases, hidden=_grouped_hidden, n_hidden=10, seed=seed)
