"""Red team for chapter 00's exercises (gather_values, linear_params) on the grader: the book's solution and honest
variants pass; the library (labutils.collectives, labutils.params.count_params), the renamed coursework copy, pasted
library or checker code, a lookup table, exec/eval, a library reached through ``torch.sys`` and the chapter's known
wrong answers fail, each naming the rule it broke where one applies. gather_values runs on ranks the grader starts
(3, and a hidden world of 2-4), each rank's inputs drawn after the ranks exist: those tests are marked ``dist``."""
import re

import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook.checkers import ch00
from labutils.collectives import all_gather_same_dim, all_gather_variable_dim
from labutils.params import count_params


def only_hidden_wrong(report):
    """Every visible case matched; the cases that did not are hidden ones (the shortcut fits the printed cases)."""
    wrong = re.search(r"\(([^)]*)\); hidden seed", report.reason).group(1).replace(" ...", "").split(", ")
    assert all(label.startswith("hidden") for label in wrong), report.text()


@pytest.fixture(scope="module")
def copy_on_disk(tmp_path_factory):
    """A real renamed coursework copy exists on this machine while its shortcut is graded (it still may not be used)."""
    return renamed_copy(str(tmp_path_factory.mktemp("coursework")))


# --- exercise 1: gather_values, on every rank ------------------------------------------------------------------

GATHER = "gather_values"


@pytest.mark.dist
def test_gather_values_books_solution_passes_on_every_rank():
    report = passes(GATHER, solution(GATHER))
    assert "all 2 cases match (1 visible, 1 hidden)" in report.text()
    assert "every one of the 3 ranks holds the same, right answer" in report.text()


@pytest.mark.dist
@pytest.mark.parametrize("src", [
    """
    def gather_values(x):
        rows = []
        for r in range(dist.get_world_size()):                  # every rank broadcasts its x in turn
            buf = x.clone() if r == dist.get_rank() else torch.empty_like(x)
            dist.broadcast(buf, src=r)
            rows.append(buf)
        return torch.stack(rows)
    """,
    """
    def gather_values(x):
        world, rank = dist.get_world_size(), dist.get_rank()
        buf = torch.zeros(world, x.numel(), dtype=x.dtype).index_copy(0, torch.tensor([rank]), x.reshape(1, -1))
        dist.all_reduce(buf)                                    # zeros elsewhere: the sum is every rank's row
        return buf
    """,
    """
    def gather_values(x):
        buf = torch.zeros(dist.get_world_size(), x.numel(), dtype=x.dtype)
        buf[dist.get_rank()] = x                                # my row; all_reduce fills the others
        dist.all_reduce(buf)
        return buf
    """,
], ids=["broadcast-in-turn", "all-reduce-index-copy", "all-reduce-own-row"])
def test_gather_values_honest_variants_pass(src):
    passes(GATHER, src)


@pytest.mark.dist
@pytest.mark.parametrize("src, rule", [
    ("""
    from labutils.collectives import all_gather_same_dim
    def gather_values(x):
        return torch.stack(all_gather_same_dim(x))
    """, "import"),
    ("""
    def gather_values(x):
        lab = torch.sys.modules["labutils.collectives"]
        return torch.stack(lab.all_gather_same_dim(x))
    """, "module-escape"),
    ("""
    SRC = "out = [torch.empty_like(x) for _ in range(dist.get_world_size())]; dist.all_gather(out, x)"
    def gather_values(x):
        ns = {"torch": torch, "dist": dist, "x": x}
        exec(SRC, ns)
        return torch.stack(ns["out"])
    """, "dynamic-code"),
    ("""
    def gather_values(x):                                       # the cheat that passed before: no communication
        return torch.arange(dist.get_world_size())
    """, None),
    ("""
    def gather_values(x):                                       # only my own value, world times
        return x.expand(dist.get_world_size(), -1).clone()
    """, None),
    ("""
    def gather_values(x):                                       # a gather to rank 0: the other ranks lack it
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        dist.gather(x, out, dst=0)
        return torch.stack(out) if out is not None else x.expand(dist.get_world_size(), -1).clone()
    """, None),
    ("""
    TABLE = {4: [[412, -95113, 700231, 3], [-5, 88, 123456, -999999], [17, 0, -42, 31337]]}   # an earlier run's
    def gather_values(x):
        return torch.tensor(TABLE.get(x.numel(), [[0] * x.numel()] * dist.get_world_size()))
    """, None),
], ids=["labutils-collectives", "library-via-torch.sys", "exec-source", "arange-no-collective",
        "own-value-repeated", "gather-to-rank-0", "lookup-table"])
def test_gather_values_shortcuts_fail(src, rule):
    fails(GATHER, src, rule)


@pytest.mark.dist
def test_gather_values_renamed_copy_is_an_import(copy_on_disk):
    fails(GATHER, """
    from mylab.labutils.collectives import all_gather_same_dim
    def gather_values(x):
        return torch.stack(all_gather_same_dim(x))
    """, "import")


@pytest.mark.dist
@pytest.mark.parametrize("fn, call", [
    (all_gather_same_dim, "torch.stack(all_gather_same_dim(args[0]))"),
    (all_gather_variable_dim, "all_gather_variable_dim(args[0].unsqueeze(0))[0]"),
], ids=["all_gather_same_dim", "all_gather_variable_dim"])
def test_gather_values_pasted_library_code_is_identity(fn, call):
    fails(GATHER, pasted(fn, GATHER, call), "identity")


# --- exercise 2: linear_params ----------------------------------------------------------------------------------

LINEAR = "linear_params"
LINEAR_TABLE = {c: ch00.CASES[LINEAR]().reference(*c) for c in ch00.CASES[LINEAR]().visible}


def test_linear_params_books_solution_passes():
    assert "all 11 cases match (3 visible, 8 hidden)" in passes(LINEAR, solution(LINEAR)).text()


@pytest.mark.parametrize("src", [
    """
    def linear_params(d_in, d_out, bias=True):
        return d_out * (d_in + int(bias))                       # each output: d_in weights and maybe one bias
    """,
    """
    def linear_params(d_in, d_out, bias=True):
        total = 0
        for _row in range(d_out):
            total += d_in
            if bias:
                total += 1
        return total
    """,
    """
    def linear_params(d_in, d_out, bias=True):
        shapes = [(d_out, d_in)] + ([(d_out,)] if bias else [])
        return torch.tensor(sum(math.prod(s) for s in shapes))  # an int64 tensor is an integer answer
    """,
], ids=["factored", "row-by-row-loop", "shapes-listed-tensor"])
def test_linear_params_honest_variants_pass(src):
    passes(LINEAR, src)


@pytest.mark.parametrize("src, rule, says", [
    ("""
    from labutils.params import count_params
    def linear_params(d_in, d_out, bias=True):
        return count_params(torch.nn.Linear(d_in, d_out, bias=bias, device="meta")).total
    """, "import", None),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return sum(p.numel() for p in torch.nn.Linear(d_in, d_out, bias=bias, device="meta").parameters())
    """, "exercise", None),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return torch.sys.modules["labbook.checkers.ch00"].CASES["linear_params"]().reference(d_in, d_out, bias)
    """, "module-escape", None),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return eval("d_in * d_out + (d_out if bias else 0)")
    """, "dynamic-code", None),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return d_in * d_out + d_out                             # the bias flag ignored
    """, None, None),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return float(d_in * d_out + (d_out if bias else 0))     # a float count
    """, None, "an integer answer expected"),
    ("""
    def linear_params(d_in, d_out, bias=True):
        return (d_in * d_out + (d_out if bias else 0)) * (1 + 1e-7)   # "close enough"
    """, None, "an integer answer expected"),
], ids=["count_params", "nn.Linear-numel", "checker-via-torch.sys", "eval-formula", "bias-ignored", "float-count",
        "relative-tolerance"])
def test_linear_params_shortcuts_fail(src, rule, says):
    fails(LINEAR, src, rule, says)


def test_linear_params_renamed_copy_is_an_import(copy_on_disk):
    fails(LINEAR, """
    import mylab.labutils.params as lab
    def linear_params(d_in, d_out, bias=True):
        return d_in * d_out + (d_out if bias else 0)
    """, "import")


def test_linear_params_lookup_table_fits_only_the_visible_cases():
    src = (f"TABLE = {LINEAR_TABLE!r}\n\ndef linear_params(d_in, d_out, bias=True):\n"
           "    return TABLE.get((d_in, d_out, bias), 0)\n")
    only_hidden_wrong(fails(LINEAR, src))


def test_linear_params_pasted_count_params_is_refused():
    """Pasted count_params counts a built layer's parameters: the exercise's own rule refuses it. (The checker's
    two-line reference is formula-sized, under identity's floor: pasting it is writing the formula.)"""
    fails(LINEAR, pasted(count_params, LINEAR, "count_params(torch.nn.Linear(*args, device='meta')).total"),
          "exercise")
