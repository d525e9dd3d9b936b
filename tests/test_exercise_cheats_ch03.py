"""Red team for chapter 03's exercise (labbook/checkers/ch03.py): the honest count passes; the library, a
module built and counted by hand, a lookup table of the visible cases, the notebook's own counts and a count off
by the router's biases (which a relative tolerance let through) all fail."""
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch03
from labutils import count_params
from labutils.moe import FMoETransformerMLP, NaiveGate
from labutils.moe.layers import FMoE


def honest(num_expert, d_model, d_hidden):
    experts = num_expert * (d_model * d_hidden + d_hidden + d_hidden * d_model + d_model)
    return torch.tensor(experts + d_model * num_expert + num_expert)


def test_honest_passes_and_a_plain_int_is_accepted():
    must_pass(ch03.check_moe_layer_params, honest)
    must_pass(ch03.check_moe_layer_params, lambda e, d, h: int(honest(e, d, h)))


def _layer(e, d, h):
    with torch.device("meta"):
        return FMoETransformerMLP(num_expert=e, d_model=d, d_hidden=h, gate=NaiveGate)


def test_the_library_fails():
    must_fail(ch03.check_moe_layer_params, lambda e, d, h: torch.tensor(count_params(_layer(e, d, h)).total),
              "count_params on the real layer")


def test_summing_private_parameters_with_mark_parallel_comm_disabled_fails(monkeypatch):
    monkeypatch.setattr(FMoE, "mark_parallel_comm", lambda self, *a, **k: None)

    def sibling(e, d, h):
        layer = _layer(e, d, h)
        return torch.tensor(sum(p.numel() for m in layer.modules() for p in m._parameters.values() if p is not None))

    must_fail(ch03.check_moe_layer_params, sibling, "summing _parameters of the real layer")


def test_a_layer_rebuilt_from_torch_modules_fails():
    def rebuilt(e, d, h):
        with torch.device("meta"):
            parts = [torch.nn.Linear(d, h), torch.nn.Linear(h, d)] * e + [torch.nn.Linear(d, e)]
        return torch.tensor(sum(p.numel() for m in parts for p in m._parameters.values() if p is not None))

    must_fail(ch03.check_moe_layer_params, rebuilt, "nn.Linear modules counted")


_TABLE = {case: int(honest(*case)) for case in ch03.VISIBLE}


def test_a_lookup_table_of_the_visible_cases_fails():
    must_fail(ch03.check_moe_layer_params, lambda e, d, h: torch.tensor(_TABLE[(e, d, h)]), "lookup table")


def test_the_notebooks_counts_fail():
    # chapter 03 holds book_counts = count_params(book_model()) for (32, 1024, 4096); computed before the check
    book_counts = count_params(_layer(32, 1024, 4096))

    def from_notebook(e, d, h):
        if (e, d, h) == (32, 1024, 4096):
            return torch.tensor(book_counts.total)
        return torch.tensor(_TABLE.get((e, d, h), 0))

    must_fail(ch03.check_moe_layer_params, from_notebook, "the notebook's global counts")


def test_a_count_missing_the_router_bias_fails_exactly():
    # within rtol 1e-5 of the answer on the book's case (32 of 272,834,592), wrong as an integer
    must_fail(ch03.check_moe_layer_params, lambda e, d, h: honest(e, d, h) - e, "router bias forgotten")
    must_fail(ch03.check_moe_layer_params, lambda e, d, h: honest(e, d, h).double() * (1 + 1e-7),
              "a float count near the answer")
