"""Red team for chapter 07's exercise checkers (labbook.checkers.ch07): the honest solutions pass; the library,
a sibling that computes the same thing, a lookup table of the visible cases and the chapter's known wrong answers
(the old model solution that drops rows, torch.chunk, fastmoe's scale) fail. No workers: both exercises run in one
process."""
import numpy as np
import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch07

# --- exercise 1: shard_batch -------------------------------------------------------------------------------------


def honest_shard(x, rank, world, dim):
    base, extra = divmod(x.shape[dim], world)  # the first `extra` ranks get one row more
    return x.narrow(dim, rank * base + min(rank, extra), base + (1 if rank < extra else 0))


def old_model_solution(x, rank, world, dim):  # the chapter's solution before: drops the remainder rows
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


def torch_chunk(x, rank, world, dim):  # the old checker's reference: ceil-sized chunks, IndexError for 5 over 4
    return torch.chunk(x, world, dim=dim)[rank]


def torch_tensor_split(x, rank, world, dim):  # the rule itself, as a torch op
    return x.tensor_split(world, dim=dim)[rank]


def numpy_array_split(x, rank, world, dim):  # the same rule through numpy
    return torch.from_numpy(np.ascontiguousarray(np.array_split(x.numpy(), world, axis=dim)[rank]))


def library_batch_rows(x, rank, world, dim):  # the book's own row rule (equal splits)
    from labbook.toys import batch_rows
    return x.narrow(dim, batch_rows(x.shape[dim], rank, world).start, x.shape[dim] // world)


def deepspeed_partition_uniform(x, rank, world, dim):  # DeepSpeed's sibling: the same boundaries
    from deepspeed.runtime.utils import partition_uniform
    parts = partition_uniform(x.shape[dim], world)
    return x.narrow(dim, parts[rank], parts[rank + 1] - parts[rank])


def distributed_sampler(x, rank, world, dim):  # DistributedSampler's rule: interleaved, padded by repetition
    from torch.utils.data import DistributedSampler
    rows = list(range(x.shape[dim]))
    idx = list(DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=False))  # pyright: ignore[reportArgumentType]
    return x.index_select(dim, torch.tensor(idx, dtype=torch.long))


def _visible_shard_table():
    """Every visible case's answer, keyed by the call's arguments (what a student could copy from the printout)."""
    table = {}
    g = torch.Generator().manual_seed(7)
    for shape, rank, world, dim, ints in [((8, 3), 1, 2, 0, True), ((7, 2), 1, 2, 0, True), ((5, 3), 3, 4, 0, True),
                                          ((3, 10), 2, 3, 1, False), ((2, 4, 2), 2, 3, 0, True),
                                          ((2, 4, 6), 0, 4, 2, False)]:
        x = torch.randint(-99, 99, shape, generator=g) if ints else torch.randn(shape, generator=g)
        table[(shape, rank, world, dim)] = honest_shard(x, rank, world, dim)
    return table


SHARD_TABLE = _visible_shard_table()


def shard_lookup_table(x, rank, world, dim):
    return SHARD_TABLE[(tuple(x.shape), rank, world, dim)]


def test_honest_shard_passes(capsys):
    must_pass(ch07.check_shard_batch, honest_shard)
    assert "all 16 cases match (6 visible, 10 hidden)" in capsys.readouterr().out


def test_visible_cases_include_the_uneven_splits_of_the_issue(capsys):
    """7 rows over 2 ranks (the old solution gave rows 0-5), 5 over 4 (torch.chunk's IndexError) are visible."""
    must_fail(ch07.check_shard_batch, old_model_solution, seed=0)
    out = capsys.readouterr().out
    assert "shard_batch case 1" in out and "wrong shape" in out


@pytest.mark.parametrize("cheat", [old_model_solution, torch_chunk, torch_tensor_split, numpy_array_split,
                                   library_batch_rows, deepspeed_partition_uniform, distributed_sampler,
                                   shard_lookup_table],
                         ids=["drops-rows", "torch.chunk", "tensor_split", "numpy.array_split", "labutils-batch_rows",
                              "deepspeed-partition_uniform", "DistributedSampler", "lookup-table"])
def test_shard_cheats_fail(cheat):
    must_fail(ch07.check_shard_batch, cheat, why=cheat.__name__, seed=1)


# --- exercise 2: grouped_reduce -----------------------------------------------------------------------------------


def honest_grouped(per_rank, is_expert, ep_size):
    world = per_rank.shape[0]
    dense = per_rank.mean(0, keepdim=True).expand_as(per_rank)
    replicas = per_rank.view(world // ep_size, ep_size, -1).sum(0)  # (ep_size, P)
    return torch.where(is_expert, replicas.repeat(world // ep_size, 1) / world, dense)


def fastmoe_scale(per_rank, is_expert, ep_size):  # fastmoe keeps the sum: W times too large
    world = per_rank.shape[0]
    replicas = per_rank.view(world // ep_size, ep_size, -1).sum(0).repeat(world // ep_size, 1)
    return torch.where(is_expert, replicas, per_rank.mean(0, keepdim=True).expand_as(per_rank))


def replica_mean(per_rank, is_expert, ep_size):  # averages over the replicas instead of dividing by W
    world = per_rank.shape[0]
    replicas = per_rank.view(world // ep_size, ep_size, -1).mean(0).repeat(world // ep_size, 1)
    return torch.where(is_expert, replicas, per_rank.mean(0, keepdim=True).expand_as(per_rank))


def naive_ddp(per_rank, is_expert, ep_size):  # everything averaged over every rank: experts mixed
    return per_rank.mean(0, keepdim=True).expand_as(per_rank).clone()


def library_grouped(per_rank, is_expert, ep_size):  # the book's own reduction, on a fake module
    from labutils.data_parallel import allreduce_grouped_grads
    return allreduce_grouped_grads(torch.nn.Linear(1, 1))


def library_split(per_rank, is_expert, ep_size):  # a sibling: the book's dense/expert split
    from labutils.data_parallel import split_dense_expert
    split_dense_expert(torch.nn.Linear(1, 1))
    return honest_grouped(per_rank, is_expert, ep_size)


def _visible_grouped_table():
    g = torch.Generator().manual_seed(7)
    table = {}
    for shape, mask, ep in [((2, 5), [0, 1, 1, 0, 0], 2), ((4, 6), [1, 0, 1, 0, 1, 0], 2), ((4, 3), [1, 1, 0], 1),
                            ((6, 4), [1, 0, 0, 1], 3)]:
        x = torch.randn(shape, generator=g)
        table[(shape, ep)] = honest_grouped(x, torch.tensor(mask).bool(), ep)
    return table


GROUPED_TABLE = _visible_grouped_table()


def grouped_lookup_table(per_rank, is_expert, ep_size):
    return GROUPED_TABLE[(tuple(per_rank.shape), ep_size)]


def test_honest_grouped_passes(capsys):
    must_pass(ch07.check_grouped_reduce, honest_grouped)
    assert "all 14 cases match (4 visible, 10 hidden)" in capsys.readouterr().out


@pytest.mark.parametrize("cheat", [fastmoe_scale, replica_mean, naive_ddp, library_grouped, library_split,
                                   grouped_lookup_table],
                         ids=["fastmoe-sum-scale", "replica-mean", "naive-ddp", "labutils-allreduce_grouped_grads",
                              "labutils-split_dense_expert", "lookup-table"])
def test_grouped_cheats_fail(cheat):
    must_fail(ch07.check_grouped_reduce, cheat, why=cheat.__name__, seed=1)
