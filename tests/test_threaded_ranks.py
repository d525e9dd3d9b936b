"""The in-process ranks helper (tests/threaded_ranks.py): results by rank, a rank's error re-raised naming the rank,
a collective some rank never joins failing in seconds instead of hanging, and nothing left behind."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import RanksTimedOut, run_ranks


def _who(extra):
    return dist.get_rank(), dist.get_world_size(), extra


@pytest.mark.parametrize("world", [1, 2, 3])
def test_results_come_back_by_rank(world):
    assert run_ranks(_who, world, "x") == [(r, world, "x") for r in range(world)]


def _all_reduce_and_objects():
    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    sub = dist.new_group([0, 2])                         # every rank creates it; ranks 0 and 2 are in it
    y = torch.tensor([10.0 * dist.get_rank()])
    if dist.get_rank() != 1:
        dist.all_reduce(y, group=sub)
    return x.item(), objects, y.item()


def test_collectives_object_gathers_and_subgroups_work():
    objects = [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert run_ranks(_all_reduce_and_objects, 3) == [(6.0, objects, 20.0), (6.0, objects, 10.0),
                                                      (6.0, objects, 20.0)]


def _rank_1_raises():
    if dist.get_rank() == 1:
        raise KeyError("only rank 1")
    dist.all_reduce(torch.ones(1))                       # rank 0 waits here for a rank that is gone
    return "done"


def test_a_rank_that_raises_is_re_raised_naming_the_rank_and_releases_the_others():
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="only rank 1") as info:
        run_ranks(_rank_1_raises, 2, timeout=5)
    assert time.monotonic() - t0 < 4, "rank 0 should be released from its all_reduce, not wait for the timeout"
    assert info.value.__notes__ == ["(raised on rank 1 of 2, threaded process group)"]


def _every_rank_raises():
    raise ValueError(f"rank {dist.get_rank()} refuses")


def test_the_lowest_raising_rank_is_re_raised_and_the_others_are_named():
    with pytest.raises(ValueError, match="^rank 0 refuses") as info:
        run_ranks(_every_rank_raises, 3)
    assert info.value.__notes__ == ["(raised on rank 0 of 3, threaded process group; rank 1: ValueError: rank 1 "
                                    "refuses; rank 2: ValueError: rank 2 refuses)"]


def _rank_0_never_joins():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))                   # ranks 1 and 2 wait for rank 0, which never comes
    return dist.get_rank()




def _spin(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)                              # not in a collective: only the timeout ends the wait


def test_a_rank_stuck_outside_a_collective_times_out_too():
    with pytest.raises(RanksTimedOut, match=r"^run_ranks: rank 1 of 2 did not finish within 0.3 s.*finished: \[0\]"):
        run_ranks(_spin, 2, 0.9, timeout=0.3)
    time.sleep(0.2)                                      # let the sleeper end before the next test


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_world_must_be_a_positive_int(world):
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        run_ranks(_who, world, None)


def test_the_main_thread_has_no_process_group_before_or_after():
    assert not dist.is_initialized()
    run_ranks(_who, 2, None)
    assert not dist.is_initialized()
