"""Red team for chapter 07's exercises (shard_batch, grouped_reduce): the book's solutions and honest variants pass;
the library, its renamed copy, the splitting ops that implement the rule (by name, through torch's doors or through
a module reached from torch), pasted library and checker code, lookup tables and the chapter's known wrong answers
fail, each naming the rule it broke where one applies. The grouped reduction's tolerance is per case: the book's
solution passes 2,000 hidden cases (it failed 11 of 2,000 under 0.3.0's fixed tolerance), and an answer off by a
relative 1e-4 on the expert columns does not."""
import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook.checkers import ch07
from labutils import data_parallel

SHARD, GROUPED = "shard_batch", "grouped_reduce"


def test_the_books_solutions_pass():
    assert "all 16 cases match (6 visible, 10 hidden)" in passes(SHARD, solution(SHARD)).text()
    assert "all 14 cases match (4 visible, 10 hidden)" in passes(GROUPED, solution(GROUPED)).text()


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
    """
    def shard_batch(x, rank, world, dim):
        start = stop = 0
        for r in range(rank + 1):                               # walk the ranks, each taking its share
            start = stop
            stop += x.shape[dim] // world + (1 if r < x.shape[dim] % world else 0)
        return x.movedim(dim, 0)[start:stop].movedim(0, dim)
    """,
], ids=["index_select", "split-by-sizes", "movedim-slice"])
def test_shard_batch_honest_variants_pass(src):
    passes(SHARD, src)


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
    passes(GROUPED, src)


def test_the_books_grouped_reduce_passes_2000_hidden_cases():
    report = passes(GROUPED, solution(GROUPED), n_hidden=2000)
    assert "all 2004 cases match (4 visible, 2000 hidden)" in report.text()


def test_a_grouped_reduce_off_by_1e4_on_the_expert_columns_fails():
    off = solution(GROUPED).replace("return torch.where(is_expert, expert, dense)",
                                    "return torch.where(is_expert, expert * (1 + 1e-4), dense)")
    assert off != solution(GROUPED)
    report = fails(GROUPED, off, n_hidden=50)
    assert "case 1" in report.reason                          # a visible case with expert columns already fails


@pytest.fixture(scope="module")
def copy_on_disk(tmp_path_factory):
    return renamed_copy(str(tmp_path_factory.mktemp("coursework")))


@pytest.mark.parametrize("name, module", [
    (SHARD, "from mylab.data_parallel import GroupedDataParallel"),
    (GROUPED, "from mylab.labutils.data_parallel import allreduce_grouped_grads"),
    (GROUPED, "import mylab"),
])
def test_the_renamed_copy_is_an_import(copy_on_disk, name, module):
    assert copy_on_disk.is_dir()                              # on disk, and still refused
    args = "x, rank, world, dim" if name == SHARD else "per_rank, is_expert, ep_size"
    fails(name, f"{module}\n\ndef {name}({args}):\n    return None\n", "import")


@pytest.mark.parametrize("src, rule", [
    ("def shard_batch(x, rank, world, dim):\n    return x.tensor_split(world, dim)[rank]", "exercise"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.chunk(x, world, dim)[rank]", "exercise"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.ops.aten.tensor_split(x, world, dim)[rank]",
     "torch-door"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.hsplit(x, world)[rank]", "exercise"),
    ("def shard_batch(x, rank, world, dim):\n    return getattr(x, 'tensor_split')(world, dim)[rank]", "reflection"),
    ("import numpy as np\ndef shard_batch(x, rank, world, dim):\n"
     "    return torch.from_numpy(np.array_split(x.numpy(), world, dim)[rank])", "import"),
    ("from labbook.toys import batch_rows\ndef shard_batch(x, rank, world, dim):\n"
     "    return x.narrow(dim, batch_rows(x.shape[dim], rank, world).start, x.shape[dim] // world)", "import"),
    ("from deepspeed.runtime.utils import partition_uniform\ndef shard_batch(x, rank, world, dim):\n"
     "    p = partition_uniform(x.shape[dim], world)\n    return x.narrow(dim, p[rank], p[rank + 1] - p[rank])",
     "import"),
    ("from torch.utils.data import DistributedSampler\ndef shard_batch(x, rank, world, dim):\n"
     "    idx = list(DistributedSampler(range(x.shape[dim]), world, rank, shuffle=False))\n"
     "    return x.index_select(dim, torch.tensor(idx))", "import"),
    ("def shard_batch(x, rank, world, dim):\n    return torch.utils.data.DistributedSampler", "torch-door"),
    ("from labutils.data_parallel import split_dense_expert\ndef grouped_reduce(p, e, k):\n    return p", "import"),
    ("from labutils.data_parallel import allreduce_grouped_grads\ndef grouped_reduce(p, e, k):\n"
     "    return allreduce_grouped_grads(torch.nn.Linear(1, 1))", "import"),
    ("from labbook.checkers.ch07 import _grouped_reference\ndef grouped_reduce(p, e, k):\n"
     "    return _grouped_reference(p, e, k)", "import"),
], ids=["tensor_split", "torch.chunk", "aten-op", "hsplit", "getattr", "numpy-array_split", "labbook-batch_rows",
        "deepspeed-partition_uniform", "DistributedSampler", "torch.utils", "split_dense_expert",
        "allreduce_grouped_grads", "checker-reference"])
def test_shortcuts_fail_naming_the_rule(src, rule):
    fails(SHARD if "shard_batch" in src else GROUPED, src, rule)


@pytest.mark.parametrize("src", [
    """
    def shard_batch(x, rank, world, dim):                    # the answer op, its name built from two strings
        split = torch.functional.operator.attrgetter("tensor" + "_split")
        return split(x)(world, dim)[rank]
    """,
    """
    def shard_batch(x, rank, world, dim):
        return torch.functional.operator.methodcaller("tensor_" + "split", world, dim)(x)[rank]
    """,
], ids=["attrgetter", "methodcaller"])
def test_the_split_ops_reached_through_a_module_escape_are_refused(src):
    """torch.functional.operator is the stdlib's operator module, reached through torch: its attrgetter and
    methodcaller take the answer op's name as a string, which no name-based rule sees."""
    fails(SHARD, src, "module-escape")


@pytest.mark.parametrize("name, fn, rules", [(SHARD, ch07._shard_reference, ("identity",)),
                                             (GROUPED, ch07._grouped_reference, ("identity",)),
                                             (GROUPED, data_parallel.allreduce_grouped_grads, ("identity", "private"))],
                         ids=["shard-reference", "grouped-reference", "allreduce_grouped_grads"])
def test_pasted_checker_and_library_code_is_refused(name, fn, rules):
    """The checkers' references by identity; the library's by identity, or by the policy where it reads a dunder."""
    text = fails(name, pasted(fn, name, f"{fn.__name__}(*args)")).text()
    assert any(f"rule '{r}'" in text for r in rules), text


@pytest.mark.parametrize("name, src", [
    (SHARD, """
    def shard_batch(x, rank, world, dim):                    # the chapter's old solution: drops the remainder
        n = x.shape[dim] // world
        return x.narrow(dim, rank * n, n)
    """),
    (SHARD, """
    def shard_batch(x, rank, world, dim):                    # the last rank takes the remainder
        size = x.shape[dim] // world
        start = rank * size
        return x.narrow(dim, start, x.shape[dim] - start if rank == world - 1 else size)
    """),
    (SHARD, """
    def shard_batch(x, rank, world, dim):                    # interleaved: rows r, r + world, ...
        return x.index_select(dim, torch.arange(rank, x.shape[dim], world))
    """),
    (SHARD, """
    def shard_batch(x, rank, world, dim):                    # ceil-sized shards (torch.chunk's rule)
        size = -(-x.shape[dim] // world)
        return x.narrow(dim, min(rank * size, x.shape[dim]), max(0, min(size, x.shape[dim] - rank * size)))
    """),
    (GROUPED, """
    def grouped_reduce(per_rank, is_expert, ep_size):        # naive DDP: expert gradients averaged over every rank
        return per_rank.mean(0, keepdim=True).expand_as(per_rank).clone()
    """),
    (GROUPED, """
    def grouped_reduce(per_rank, is_expert, ep_size):        # fastmoe's scale: replicas summed, not divided by W
        world = per_rank.shape[0]
        rep = per_rank.view(world // ep_size, ep_size, -1).sum(0).repeat(world // ep_size, 1)
        return torch.where(is_expert, rep, per_rank.mean(0).expand_as(per_rank))
    """),
    (GROUPED, """
    def grouped_reduce(per_rank, is_expert, ep_size):        # replicas averaged instead of divided by W
        world = per_rank.shape[0]
        rep = per_rank.view(world // ep_size, ep_size, -1).mean(0).repeat(world // ep_size, 1)
        return torch.where(is_expert, rep, per_rank.mean(0).expand_as(per_rank))
    """),
], ids=["drops-rows", "last-takes-remainder", "interleaved", "chunk-rule", "naive-ddp", "fastmoe-sum-scale",
        "replica-mean"])
def test_known_wrong_answers_fail(name, src):
    fails(name, src)


def test_a_lookup_table_of_the_visible_shards_fails_the_hidden_ones():
    table = {str(c[0].tolist()) + str(c[1:]): ch07._shard_reference(*c).tolist() for c in ch07._shard_visible()}
    src = (f"TABLE = {table!r}\n\ndef shard_batch(x, rank, world, dim):\n"
           "    return torch.tensor(TABLE[str(x.tolist()) + str((rank, world, dim))], dtype=x.dtype)\n")
    assert "0 of 10 hidden cases match" in fails(SHARD, src).text()


def test_a_lookup_table_of_the_visible_reductions_fails_the_hidden_ones():
    table = {(tuple(c[0].shape), c[2]): ch07._grouped_reference(*c).tolist() for c in ch07._grouped_visible()}
    src = (f"TABLE = {table!r}\n\ndef grouped_reduce(per_rank, is_expert, ep_size):\n"
           "    return torch.tensor(TABLE[(tuple(per_rank.shape), ep_size)])\n")
    report = fails(GROUPED, src)
    assert "case 0" not in report.reason and "hidden 0" in report.reason
