"""Exercise checkers fail when the student just calls the library function (labutils.exercises.forbid)."""
import pytest
import torch

from labutils.exercises import OffLimits, check_exercise, forbid
from labutils.moe import FMoETransformerMLP, count_by_gate
from labutils.moe.functions import MOEGatherCombine


def honest(gate_idx, num_expert):
    flat = gate_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_expert)
    pos = torch.argsort(key, stable=True)[: int((flat >= 0).sum())]
    return pos, torch.bincount(flat[flat >= 0], minlength=num_expert)


def calls_the_library(gate_idx, num_expert):
    return count_by_gate(gate_idx, num_expert)[:2]


CASES = [(torch.tensor([[0, 2], [1, -1], [2, 0]]), 3), (torch.zeros(0, 2, dtype=torch.long), 4)]


def test_an_honest_solution_passes_and_the_library_may_be_the_reference(capsys):
    check_exercise("count_by_gate", honest, lambda i, e: count_by_gate(i, e)[:2], *CASES,
                   forbidden=[count_by_gate])
    assert "all 2 cases match" in capsys.readouterr().out


def test_calling_the_library_fails_the_checker_and_says_why(capsys):
    with pytest.raises(AssertionError, match="2 of 2 cases wrong"):
        check_exercise("count_by_gate", calls_the_library, lambda i, e: count_by_gate(i, e)[:2], *CASES,
                       forbidden=[count_by_gate])
    assert "count_by_gate is off limits" in capsys.readouterr().out
    # negative control of the control: without `forbidden` the same copy-the-library answer passes
    check_exercise("count_by_gate", calls_the_library, lambda i, e: count_by_gate(i, e)[:2], *CASES)


def test_forbid_blocks_modules_and_autograd_functions_and_restores_them():
    layer = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16)
    x = torch.randn(3, 8)
    before = layer(x)
    with forbid(FMoETransformerMLP), pytest.raises(OffLimits, match="FMoETransformerMLP is off limits"):
        layer(x)
    with forbid(MOEGatherCombine), pytest.raises(OffLimits, match="MOEGatherCombine is off limits"):
        layer(x)
    with forbid(count_by_gate), pytest.raises(OffLimits):
        count_by_gate(torch.tensor([[0, 1]]), 2)
    torch.manual_seed(0)
    assert layer(x).shape == before.shape and count_by_gate(torch.tensor([[0, 1]]), 2)[1].tolist() == [1, 1]
    with pytest.raises(TypeError, match="plain functions and classes"), forbid(3):
        pass
