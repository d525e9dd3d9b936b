"""Chapter 00's exercise checkers: gathering every rank's tensor with a collective (checked on every rank, with
rank-unique inputs from a seed the student does not see) and the parameter count of ``nn.Linear`` (integers,
compared exactly). Serves notebooks/00_setup.ipynb; red-teamed by tests/test_exercise_cheats_ch00.py."""
from __future__ import annotations

import torch

from labbook.exercises import check_exercise, guarded_call
from labutils.launcher import WorkerError, launch

# --- exercise 1: gather_values(x) on every rank -----------------------------------------------------------


def rank_value(seed: int, rank: int, n: int) -> torch.Tensor:
    """The input rank ``rank`` holds in case ``seed``: ``(n,)`` int64, values unique to the rank (drawn from
    ``seed`` and ``rank``)."""
    g = torch.Generator().manual_seed(int(seed) * 1009 + 7919 * (rank + 1))
    return torch.randint(-10**6, 10**6, (n,), generator=g)                   # (n,)


def _on_rank(fn, n, seeds):
    """Runs on every rank: ``fn(x)`` under the guard for each seed. Returns (results, violations)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    results, violations = [], []
    for seed in seeds:
        got, seen = guarded_call(fn, rank_value(seed, rank, n))
        violations += seen
        results.append(got)
    return results, violations


def _gathered_on_every_rank(fn, world: int, n: int, seeds: tuple) -> torch.Tensor:
    """Launch ``world`` workers, call ``fn`` on each; ``(world, len(seeds), world, n)``: what every rank got."""
    try:
        per_rank = launch(_on_rank, world, fn, n, seeds, timeout=90)
    except WorkerError as err:  # a blank exercise or a failing one: the remote error, named
        raise RuntimeError(f"a worker failed: {str(err).splitlines()[0]}\n{err.remote_traceback[-600:]}") from None
    rows = []
    for rank, (results, violations) in enumerate(per_rank):
        if violations:
            raise RuntimeError(f"OFF LIMITS on rank {rank}: {violations[0]} (write it with torch.distributed)")
        rows.append(torch.stack([torch.as_tensor(r) for r in results]))      # (S, world, n)
    return torch.stack(rows)                                                 # (world, S, world, n)


def _gather_reference(world: int, n: int, seeds: tuple) -> torch.Tensor:
    """Every rank must hold every rank's input, in rank order: ``(world, S, world, n)``."""
    one = torch.stack([torch.stack([rank_value(s, r, n) for r in range(world)]) for s in seeds])  # (S, world, n)
    return one.expand(world, *one.shape).clone()


def check_gather_values(fn, seed: int | None = None) -> None:
    """``fn(x)`` runs on each of ``world`` workers with that rank's ``(n,)`` int64 ``x`` and must return the
    ``(world, n)`` stack of every rank's ``x`` in rank order, on EVERY rank. One visible launch (3 workers, two
    inputs each) and one hidden (2 to 4 workers, 3 inputs each); calls into labutils (its collectives), DeepSpeed
    or fastmoe from ``fn`` are refused on the workers."""
    def hidden(gen, i):
        world = int(torch.randint(2, 5, (1,), generator=gen))
        n = int(torch.randint(1, 6, (1,), generator=gen))
        return world, n, tuple(int(s) for s in torch.randint(0, 2**31, (3,), generator=gen))

    def run(world, n, seeds):  # the launch happens outside any guard; the guard runs on every rank
        return _gathered_on_every_rank(fn, world, n, seeds)

    check_exercise("gather_values", run, _gather_reference, (3, 4, (12, 13)),
                   hidden=hidden, n_hidden=1, seed=seed, roots=())


# --- exercise 2: linear_params(d_in, d_out, bias) -----------------------------------------------------


def _linear_params_reference(d_in: int, d_out: int, bias: bool) -> int:
    """Counted entry by entry from the definition y = W x (+ b): W has d_out rows of d_in, b has d_out."""
    weights = sum(d_in for _ in range(d_out))
    return weights + (d_out if bias else 0)


def check_linear_params(fn, seed: int | None = None) -> None:
    """``fn(d_in, d_out, bias)`` -> the number of parameters of ``nn.Linear(d_in, d_out, bias=bias)``, an integer
    compared exactly. Building a module (any ``torch.empty``: ``nn.Linear`` on any device) or calling labutils'
    ``count_params`` inside ``fn`` is refused: write the formula."""
    def hidden(gen, i):
        d_in, d_out = (int(v) for v in torch.randint(1, 5000, (2,), generator=gen))
        return d_in, d_out, bool(torch.randint(0, 2, (1,), generator=gen))

    check_exercise("linear_params", fn, _linear_params_reference, (3, 4, True), (1024, 4096, True), (7, 1, False),
                   hidden=hidden, seed=seed, ops={"empty", "empty_like", "empty_strided"})
