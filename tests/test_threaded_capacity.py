"""labutils.moe.capacity's multi-rank paths on 2 and 3 in-process ranks (tests/threaded_ranks.py): the counts
exchange (fastmoe's expert_exchange) and limit_by_capacity with world_size > 1 and group=, against values worked
out by hand and a plain loop over every rank's choices. tests/test_fastmoe_dist.py runs limit_by_capacity in gloo
workers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks

from labutils.moe.capacity import exchange_counts, limit_by_capacity


def caught(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # the tests assert the type
        return type(exc).__name__, str(exc)


# ---- exchange_counts --------------------------------------------------------------------------------------------
def test_exchange_counts_on_one_worker_is_a_copy():
    counts = torch.tensor([3, 1, 4])
    out = exchange_counts(counts, 1)
    assert out.tolist() == [3, 1, 4] and out is not counts
    out[0] = 9
    assert counts[0] == 3




def _exchange(dtype, strided):
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.tensor([10 * rank + i for i in range(2 * world * (2 if strided else 1))], dtype=dtype)
    if strided:
        counts = counts[::2]                                             # a non-contiguous view: 10r + 0, 2, 4...
    out = exchange_counts(counts, world)
    return out.tolist(), out.dtype


def test_exchange_counts_by_hand():
    # 2 workers, 2 experts each: rank r holds [10r, 10r + 1 | 10r + 2, 10r + 3]; block w goes to rank w
    assert run_ranks(_exchange, 2, torch.int64, False) == [([0, 1, 10, 11], torch.int64),
                                                          ([2, 3, 12, 13], torch.int64)]
    assert run_ranks(_exchange, 2, torch.int32, True) == [([0, 2, 10, 12], torch.int32),
                                                         ([4, 6, 14, 16], torch.int32)]


def test_exchange_counts_three_workers():
    got = run_ranks(_exchange, 3, torch.int64, False)
    for dst in range(3):
        assert got[dst][0] == [10 * src + 2 * dst + i for src in range(3) for i in range(2)]


def _exchange_group():
    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return caught(lambda: exchange_counts(torch.zeros(2, dtype=torch.long), 2))   # the world has 3 ranks
    return exchange_counts(torch.tensor([10 * rank, 10 * rank + 1]), 2, sub).tolist()


def test_exchange_counts_over_a_group_and_a_world_size_that_is_not_the_groups():
    got = run_ranks(_exchange_group, 3)
    assert got[0] == [0, 20] and got[2] == [1, 21]
    assert got[1] == ("ValueError", "exchanging expert counts over world_size=2 workers: world_size=2, but the process "
                                    "group has 3 ranks")


# ---- limit_by_capacity ----------------------------------------------------------------------------------------
CHOICES = {2: [[[0, 1], [1, 2], [3, 0], [1, -1]],            # rank 0: 4 tokens, top-2, 4 global experts
               [[1, 0], [1, 3], [0, 1]]],                    # rank 1: 3 tokens
           3: [[[0, 5], [2, 1], [5, 4], [0, 0]],             # 6 global experts (2 per rank); a token may pick twice
               [[], ],                                       # rank 1: no token at all
               [[5, -1], [1, 0], [4, 5], [3, 2], [0, 1]]]}


def _choices(world, rank):
    rows = CHOICES[world][rank]
    return torch.tensor(rows if rows[0] else [], dtype=torch.long).reshape(-1, 2)


def _limit(world_size, capacity, subgroup):
    rank = dist.get_rank()
    group = None
    if subgroup:
        group = dist.new_group([0, 2])
        if rank == 1:
            return None
        rank = dist.get_rank(group)
    idx = _choices(world_size, rank)
    cap = torch.tensor(capacity) if isinstance(capacity, list) else capacity
    new_lec, new_gec, new_idx = limit_by_capacity(idx, 2, world_size=world_size, capacity=cap, group=group)
    return new_lec.tolist(), new_gec.tolist(), new_idx.tolist(), idx.tolist()


def test_limit_by_capacity_two_workers_by_hand():
    # rank 0 routes 2, 3, 1, 1 choices to experts 0..3, rank 1 routes 2, 3, 0, 1. Capacity 2 per expert, rank 0's
    # first: rank 0 is granted 2, 2, 1, 1 and rank 1 0, 0, 0, 1 (expert 3 has room for one more).
    got = run_ranks(_limit, 2, 2, 2, False)
    assert got[0][:2] == ([2, 2, 1, 1], [2, 2, 0, 0])     # new_gec on rank 0: its experts 0, 1 from ranks 0 and 1
    assert got[1][:2] == ([0, 0, 0, 1], [1, 1, 0, 1])     # rank 1's experts 2, 3 from ranks 0 and 1
    # rank 0, expert 1: first choices of tokens 1 and 3 come before token 0's second choice, which is dropped
    assert got[0][2] == [[0, -1], [1, 2], [3, 0], [1, -1]]
    assert got[1][2] == [[-1, -1], [-1, 3], [-1, -1]]
    assert [g[3] for g in got] == [CHOICES[2][0], CHOICES[2][1]]           # the input is not changed


def test_limit_by_capacity_per_expert_capacity_by_hand():
    # local expert 0 of each rank (global 0, 2) takes 1, local expert 1 (global 1, 3) takes 3
    got = run_ranks(_limit, 2, 2, [1, 3], False)
    assert got[0][:3] == ([1, 3, 1, 1], [1, 3, 0, 0], [[0, 1], [1, 2], [3, -1], [1, -1]])
    assert got[1][:3] == ([0, 0, 0, 1], [1, 1, 0, 1], [[-1, -1], [-1, 3], [-1, -1]])


def _granted(choices, num_expert, capacity):
    """Plain loop: choices granted to each rank by each global expert (earlier ranks first)."""
    world = len(choices)
    tot = num_expert * world
    cap = [capacity[g % num_expert] if isinstance(capacity, list) else capacity for g in range(tot)]
    granted = [[0] * tot for _ in range(world)]
    for g in range(tot):
        left = cap[g]
        for w in range(world):
            n = sum(1 for row in choices[w] for e in row if e == g)
            granted[w][g] = min(n, left)
            left -= granted[w][g]
    return granted


def _kept(rows, granted_row):
    """Plain loop: first choices of every token first, then second choices; beyond the grant: -1."""
    out = [list(r) for r in rows]
    used: dict = {}
    for j in range(2):
        for t, row in enumerate(rows):
            e = row[j]
            if e >= 0:
                if used.get(e, 0) < granted_row[e]:
                    used[e] = used.get(e, 0) + 1
                else:
                    out[t][j] = -1
    return out


@pytest.mark.parametrize("capacity", [0, 1, 2, 5, [2, 0]])
@pytest.mark.parametrize("world", [2, 3])
def test_limit_by_capacity_matches_a_plain_loop(world, capacity):
    choices = [_choices(world, r).tolist() for r in range(world)]
    granted = _granted(choices, 2, capacity)
    got = run_ranks(_limit, world, world, capacity, False)
    for r in range(world):
        new_lec, new_gec, new_idx, _ = got[r]
        assert new_lec == granted[r], (r, new_lec)
        assert new_gec == [granted[w][2 * r + e] for w in range(world) for e in range(2)], (r, new_gec)
        assert new_idx == _kept(choices[r], granted[r]), (r, new_idx)


def test_limit_by_capacity_over_a_group():
    # ranks 0 and 2 form a 2-worker group and run the 2-worker case above; rank 1 takes no part
    got = run_ranks(_limit, 3, 2, 2, True)
    assert got[1] is None
    assert got[0][:3] == ([2, 2, 1, 1], [2, 2, 0, 0], [[0, -1], [1, 2], [3, 0], [1, -1]])
    assert got[2][:3] == ([0, 0, 0, 1], [1, 1, 0, 1], [[-1, -1], [-1, 3], [-1, -1]])


def _limit_wrong_world():
    return caught(lambda: limit_by_capacity(torch.zeros(2, 2, dtype=torch.long), 2, world_size=3, capacity=1))


