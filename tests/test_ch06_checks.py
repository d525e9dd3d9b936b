"""Chapter 06's wire check sees the side channels that the kernel's counters of open sockets miss (issue 38)."""
from __future__ import annotations

import pytest

from labutils import launch
from labutils.wire import count_wire


def _side_channels():
    import torch
    import torch.distributed as dist

    from labutils.wire import count_wire

    world = dist.get_world_size()
    out = {}
    dist.barrier()
    with count_wire() as w:                                                  # a plain collective: no side channel
        dist.all_to_all_single(torch.empty(world * 8), torch.zeros(world * 8))
        dist.barrier()
    out["plain"] = (w.sent, w.store, w.closed, w.settled)
    dist.barrier()
    with count_wire() as w:                                                  # padding through the store
        dist.distributed_c10d._get_default_store().set(f"pad{dist.get_rank()}", b"\0" * 1000)
        dist.barrier()
    out["store"] = (w.sent, w.store, w.closed, w.settled)
    dist.barrier()
    with count_wire() as w:                                                  # a group made and destroyed inside
        g = dist.new_group(backend="gloo")
        dist.all_to_all_single(torch.empty(world * 1000), torch.zeros(world * 1000), group=g)
        dist.destroy_process_group(g)
        dist.barrier()
    out["group"] = (w.sent, w.store, w.closed, w.settled)
    return out


@pytest.mark.dist
def test_count_wire_sees_the_store_and_a_group_made_inside_the_block():
    for rank, out in enumerate(launch(_side_channels, 2, timeout=90)):
        sent, store, closed, settled = out["plain"]
        assert store == 0 and closed == 0 and settled and sent > 8 * 4, (rank, out)
        assert out["store"][1] >= 1000, (rank, out)                           # at least its own value
        assert out["group"][1] > 0, (rank, out)                               # the group's rendezvous


def test_count_wire_refuses_a_settle_longer_than_its_wait():
    with pytest.raises(ValueError, match="settle"):
        count_wire(settle=1.0, max_wait=0.5)
    with pytest.raises(ValueError, match="settle"):
        count_wire(settle=-0.1)


def _repeat_counts(n):
    import torch
    import torch.distributed as dist

    from labutils.wire import count_wire

    world = dist.get_world_size()
    out = []
    for _ in range(n):
        dist.barrier()
        with count_wire() as w:                                              # no barrier inside: the count ends
            dist.all_to_all_single(torch.empty(world * 100), torch.zeros(world * 100))  # right after the call
        out.append((w.sent, w.settled))
    dist.barrier()
    return out


@pytest.mark.dist
def test_count_wire_settles_without_losing_a_byte():
    """count_wire stops re-reading once a re-read finds the counters unchanged while no other thread of the rank runs
    (not after a fixed quiet 50 ms): every one of 20 counts of the same collective, ended right after it as chapter
    07's step counts are, is the same number of bytes, and settled."""
    for rank, counts in enumerate(launch(_repeat_counts, 2, 20, timeout=90)):
        assert len({sent for sent, _ in counts}) == 1 and all(ok for _, ok in counts), (rank, counts)
        assert counts[0][0] > 100 * 4, (rank, counts)                        # the peer's 100 floats, and framing
