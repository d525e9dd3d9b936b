"""Red team for chapter 00's exercise checkers (labbook.checkers.ch00): the honest solutions pass; the library,
a sibling that computes the same thing, a lookup table of the visible cases and the known wrong answers fail."""
import pytest
import torch
import torch.distributed as dist
from cheats import must_fail, must_pass

from labbook.checkers import ch00
from labutils import count_params

# --- exercise 1: gather_values, run on every rank ---------------------------------------------------------------


def honest_gather(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.stack(out)                                        # (world, n)


def no_collective_arange(x):  # the cheat that passed before: rank numbers, no communication
    return torch.arange(dist.get_world_size())


def library_gather(x):  # the book's own variable-size all-gather
    from labutils.collectives import all_gather_variable_dim
    return all_gather_variable_dim(x.unsqueeze(0))[0].reshape(dist.get_world_size(), -1)


VISIBLE_TABLE = {tuple(ch00.rank_value(s, r, n).tolist()): ch00._gather_reference(w, n, (s,))[0, 0]
                 for w, n, seeds in [(3, 4, (12, 13))] for s in seeds for r in range(w)}


def lookup_table(x):
    return VISIBLE_TABLE[tuple(x.tolist())]


pytestmark = pytest.mark.dist


def test_honest_gather_passes_on_every_rank(capsys):
    must_pass(ch00.check_gather_values, honest_gather)
    assert "all 2 cases match (1 visible, 1 hidden)" in capsys.readouterr().out


@pytest.mark.parametrize("cheat", [no_collective_arange, library_gather, lookup_table],
                         ids=["arange-no-collective", "labutils-collectives", "lookup-table"])
def test_gather_cheats_fail(cheat):
    must_fail(ch00.check_gather_values, cheat, why=cheat.__name__, seed=3)


# --- exercise 2: linear_params ----------------------------------------------------------------------------------


def honest_params(d_in, d_out, bias=True):
    return d_in * d_out + (d_out if bias else 0)


LINEAR_TABLE = {(3, 4, True): 16, (1024, 4096, True): 4198400, (7, 1, False): 7}


@pytest.mark.parametrize("cheat", [
    lambda i, o, b=True: count_params(torch.nn.Linear(i, o, bias=b, device="meta")).total,   # the library
    lambda i, o, b=True: sum(p.numel() for p in torch.nn.Linear(i, o, bias=b, device="meta").parameters()),
    lambda i, o, b=True: LINEAR_TABLE[(i, o, b)],                                            # lookup table
    lambda i, o, b=True: i * o + o,                                                          # bias ignored
    lambda i, o, b=True: float(honest_params(i, o, b)) * (1 + 1e-7),                         # "close enough"
], ids=["count_params", "nn.Linear-numel", "lookup-table", "bias-ignored", "relative-tolerance"])
def test_linear_params_cheats_fail(cheat):
    must_fail(ch00.check_linear_params, cheat)


def test_linear_params_honest_passes_and_table_matches_the_visible_cases():
    must_pass(ch00.check_linear_params, honest_params)
    assert all(honest_params(*k) == v for k, v in LINEAR_TABLE.items())
