"""Chapter 07's exercise cases for the grader (:mod:`labbook.grader`): a rank's share of a batch along any dimension
(uneven splits included, integers compared exactly) and the grouped gradient reduction simulated on one process, each
against a brute-force reference written here, with hidden cases from a seed the student does not see. Serves
notebooks/07_data_parallel.ipynb; red-teamed by tests/test_grader_ch07.py. The splitting ops that implement the
uneven-split rule are refused by the exercise's policy (``labbook.grader.catalog.SPLITS``)."""
from __future__ import annotations

import torch

from labbook.grader.answers import Cases

# --- exercise 1: shard_batch(x, rank, world, dim) ----------------------------------------------------------------

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


def _shard_visible() -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(-99, 99, (8, 3), generator=g), 1, 2, 0),       # even: 4 + 4
            (torch.randint(-99, 99, (7, 2), generator=g), 1, 2, 0),       # 4 + 3: rows 4..6
            (torch.randint(-99, 99, (5, 3), generator=g), 3, 4, 0),       # 2 + 1 + 1 + 1: row 4
            (torch.randn(3, 10, generator=g), 2, 3, 1),                   # 4 + 3 + 3 along dim 1
            (torch.randint(-99, 99, (2, 4, 2), generator=g), 2, 3, 0),    # 1 + 1 + 0: rank 2 gets no rows
            (torch.randn(2, 4, 6, generator=g), 0, 4, 2)]                 # 2 + 2 + 1 + 1 along dim 2


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


def _grouped_tolerance(per_rank: torch.Tensor, is_expert, ep_size) -> tuple:
    """A sum of W terms in the inputs' dtype is off the exact sum by up to about (W - 1) eps max|term| however it is
    ordered; divided by W, and with the reference rounded once: atol = 2 W eps max|term|, rtol = 4 eps."""
    eps = torch.finfo(per_rank.dtype).eps
    return 4 * eps, 2 * per_rank.shape[0] * eps * float(per_rank.abs().max())


def _grouped_visible() -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 5, generator=g), torch.tensor([0, 1, 1, 0, 0]).bool(), 2),
            (torch.randn(4, 6, generator=g), torch.tensor([1, 0, 1, 0, 1, 0]).bool(), 2),
            (torch.randn(4, 3, generator=g), torch.tensor([1, 1, 0]).bool(), 1),
            (torch.randn(6, 4, generator=g), torch.tensor([1, 0, 0, 1]).bool(), 3)]


CASES = {
    "shard_batch": lambda: Cases(_shard_reference, _shard_visible(), _shard_hidden, n_hidden=10, rtol=0.0, atol=0.0),
    "grouped_reduce": lambda: Cases(_grouped_reference, _grouped_visible(), _grouped_hidden, n_hidden=10,
                                    tolerance=_grouped_tolerance),
}
