"""Red team for chapter 07's exercises (shard_batch, grouped_reduce): the book's solutions and two honest variants
each pass; the library, the splitting ops that implement the rule, pasted library code, lookup tables and near misses
fail, each naming the rule it broke. The grouped reduction's tolerance is per case: the book's solution passes 2,000
hidden cases (it failed 11 of 2,000 under 0.3.0's fixed tolerance), and an answer off by 1e-4 does not."""
import pytest
from redteam import fails, passes, pasted, solution

from labbook.checkers import ch07


def test_the_books_solutions_pass():
    assert "all 16 cases match (6 visible, 10 hidden)" in passes("shard_batch", solution("shard_batch")).text()
    assert "all 14 cases match (4 visible, 10 hidden)" in passes("grouped_reduce", solution("grouped_reduce")).text()


@pytest.mark.parametrize("src", [
    """
    def shard_batch(x, rank, world, dim):
        n = x.shape[dim]
        sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
        start = sum(sizes[:rank])
        return x.index_select(dim, torch.arange(start, start + sizes[rank]))
    """,
    """
    def shard_batch(x, rank, world, dim):
        n = x.shape[dim]
        pieces = x.split([n // world + (r < n % world) for r in range(world)], dim)
        return pieces[rank]
    """,
], ids=["index_select", "split-by-sizes"])
def test_shard_batch_honest_variants_pass(src):
    passes("shard_batch", src)


@pytest.mark.parametrize("src", [
    """
    def grouped_reduce(per_rank, is_expert, ep_size):
        world = per_rank.shape[0]
        out = per_rank.new_empty(per_rank.shape)
        for r in range(world):
            replicas = per_rank[r % ep_size::ep_size].sum(0)
            out[r] = torch.where(is_expert, replicas, per_rank.sum(0)) / world
        return out
    """,
    """
    def grouped_reduce(per_rank, is_expert, ep_size):
        world, p = per_rank.shape
        group = torch.arange(world) % ep_size
        same = (group[:, None] == group[None, :]).to(per_rank.dtype)      # (W, W): replicas of my experts
        expert = same @ per_rank / world
        dense = per_rank.mean(0).expand(world, p)
        return torch.where(is_expert, expert, dense)
    """,
], ids=["loop-over-ranks", "replica-matrix"])
def test_grouped_reduce_honest_variants_pass(src):
    passes("grouped_reduce", src)


def test_the_books_grouped_reduce_passes_2000_hidden_cases_and_a_1e4_error_fails():
    passes("grouped_reduce", solution("grouped_reduce"), n_hidden=2000)
    off = solution("grouped_reduce").replace("return torch.where(is_expert, expert, dense)",
                                             "return torch.where(is_expert, expert * (1 + 1e-4), dense)")
    assert off != solution("grouped_reduce")
    fails("grouped_reduce", off, n_hidden=50)


@pytest.mark.parametrize("src, rule", [
    ("def shard_batch(x, rank, world, dim):\n    return x.tensor_split(world, dim)[rank]", "exercise"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.chunk(x, world, dim)[rank]", "exercise"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.ops.aten.tensor_split(x, world, dim)[rank]",
     "torch-door"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.hsplit(x, world)[rank]", "exercise"),
    ("import numpy as np\ndef shard_batch(x, rank, world, dim):\n"
     "    return torch.from_numpy(np.array_split(x.numpy(), world, dim)[rank])", "import"),
    ("from labutils.data_parallel import GroupedDataParallel\ndef shard_batch(x, rank, world, dim):\n    return x",
     "import"),
    ("import mylab\ndef shard_batch(x, rank, world, dim):\n    return x", "import"),
    ("from labutils.data_parallel import GroupedDataParallel\ndef grouped_reduce(p, e, k):\n    return p", "import"),
    ("from labbook.checkers.ch07 import _grouped_reference\ndef grouped_reduce(p, e, k):\n"
     "    return _grouped_reference(p, e, k)", "import"),
], ids=["tensor_split", "torch.chunk", "aten-op", "hsplit", "numpy-array_split", "labutils", "renamed-copy",
        "labutils-dp", "checker-reference"])
def test_shortcuts_fail_naming_the_rule(src, rule):
    name = "shard_batch" if "shard_batch" in src else "grouped_reduce"
    fails(name, src, rule)


@pytest.mark.parametrize("name, fn", [("shard_batch", ch07._shard_reference),
                                      ("grouped_reduce", ch07._grouped_reference)], ids=["shard", "grouped"])
def test_the_checkers_reference_pasted_is_refused_by_identity(name, fn):
    fails(name, pasted(fn, name, f"{fn.__name__}(*args)"), "identity")


@pytest.mark.parametrize("name, src", [
    ("shard_batch", """
    def shard_batch(x, rank, world, dim):                    # the last rank takes the remainder
        size = x.shape[dim] // world
        start = rank * size
        return x.narrow(dim, start, x.shape[dim] - start if rank == world - 1 else size)
    """),
    ("shard_batch", """
    def shard_batch(x, rank, world, dim):                    # interleaved: rows r, r + world, ...
        return x.index_select(dim, torch.arange(rank, x.shape[dim], world))
    """),
    ("shard_batch", """
    def shard_batch(x, rank, world, dim):                    # ceil-sized shards (torch.chunk's rule)
        size = -(-x.shape[dim] // world)
        return x.narrow(dim, min(rank * size, x.shape[dim]), max(0, min(size, x.shape[dim] - rank * size)))
    """),
    ("grouped_reduce", """
    def grouped_reduce(per_rank, is_expert, ep_size):        # expert gradients averaged over every rank
        return per_rank.mean(0, keepdim=True).expand_as(per_rank).clone()
    """),
    ("grouped_reduce", """
    def grouped_reduce(per_rank, is_expert, ep_size):        # replicas summed but not scaled by the world size
        world = per_rank.shape[0]
        rep = per_rank.view(world // ep_size, ep_size, -1).sum(0).repeat(world // ep_size, 1)
        return torch.where(is_expert, rep, per_rank.mean(0).expand_as(per_rank))
    """),
], ids=["last-takes-remainder", "interleaved", "chunk-rule", "experts-averaged", "experts-unscaled"])
def test_near_misses_fail(name, src):
    fails(name, src)


def test_a_lookup_table_of_the_visible_cases_fails_the_hidden_ones():
    table = {str(c[0].tolist()) + str(c[1:]): ch07._shard_reference(*c).tolist() for c in ch07._shard_visible()}
    src = (f"TABLE = {table!r}\n\ndef shard_batch(x, rank, world, dim):\n"
           "    return torch.tensor(TABLE[str(x.tolist()) + str((rank, world, dim))], dtype=x.dtype)\n")
    report = fails("shard_batch", src)
    assert "0 of 10 hidden cases match" in report.text()
