"""Red team for chapter 04's exercise checkers (labbook.checkers.ch04): per exercise the honest solution
passes, and the library function, its siblings in labutils and DeepSpeed (``top1gating``'s ``l_aux`` is the same
number as top-2's), a lookup table of the visible cases, the notebook's ``l_aux_by_hand`` and the chapter's known
wrong answers fail: the capacity rounded in float64, which the chapter's own solution did (issue 24)."""
import math
from fractions import Fraction

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch04
from labutils.ds import import_deepspeed
from labutils.ds.gating import ds_capacity, exact_capacity, top1_routing, top2_routing, topk_routing
from labutils.moe.modern.losses import balance_loss

import_deepspeed()
from deepspeed.moe import sharded_moe  # noqa: E402


def _key(t):
    return (tuple(t.shape), tuple(t.reshape(-1).tolist()))


# --- exercise 1: ds_capacity --------------------------------------------------------------------------------------

def honest_ds_capacity(tokens, num_experts, k, capacity_factor, min_capacity=4):
    factor = torch.tensor(capacity_factor * k)                               # float32, as DeepSpeed
    return max(min_capacity, int(torch.ceil((tokens / num_experts) * factor)))


def float64_solution(tokens, num_experts, k, capacity_factor, min_capacity=4):  # chapter 04's old solution
    return torch.tensor(max(min_capacity, math.ceil(tokens / num_experts * capacity_factor * k)))


_TABLE = {c[:4]: ch04.deepspeed_capacity(*c) for c in ch04.CAPACITY_VISIBLE}

CAPACITY_CHEATS = {
    "library ds_capacity": lambda t, e, k, cf, m=4: ds_capacity(t, e, cf, k, m),
    "deepspeed _capacity": lambda t, e, k, cf, m=4: sharded_moe._capacity(torch.empty(t, e), torch.tensor(cf * k),
                                                                        torch.tensor(m)),
    "deepspeed TopKGate": lambda t, e, k, cf, m=4: sharded_moe.TopKGate(4, e, k=k, capacity_factor=cf,
                                                                       min_capacity=m)(torch.randn(t, 4))[1].shape[-1],
    "sibling exact_capacity": lambda t, e, k, cf, m=4: exact_capacity(t, e, cf, k, m),
    "the checker's reference": ch04.deepspeed_capacity,
    "lookup table, float64 elsewhere": lambda t, e, k, cf, m=4: _TABLE.get((t, e, k, cf),
                                                                           float64_solution(t, e, k, cf, m)),
    "rounded in float64 (the old solution)": float64_solution,
    "exact fraction": lambda t, e, k, cf, m=4: max(m, math.ceil(Fraction(str(cf)) * k * t / e)),
}


def test_ds_capacity_in_float32_passes():
    must_pass(ch04.check_ds_capacity, honest_ds_capacity)


@pytest.mark.parametrize("name", CAPACITY_CHEATS)
def test_ds_capacity_cheats_fail(name):
    must_fail(ch04.check_ds_capacity, CAPACITY_CHEATS[name], name)


def test_the_issue_example_is_a_visible_case_and_the_old_solution_misses_it():
    assert (100, 4, 1, 1.2, 0) in ch04.CAPACITY_VISIBLE
    assert ch04.deepspeed_capacity(100, 4, 1, 1.2, 0) == 31 != int(float64_solution(100, 4, 1, 1.2, 0))


def test_the_old_solution_fails_on_hidden_cases_alone(monkeypatch):
    monkeypatch.setattr(ch04, "CAPACITY_VISIBLE", tuple(c for c in ch04.CAPACITY_VISIBLE if c[:4] != (100, 4, 1, 1.2)))
    must_fail(ch04.check_ds_capacity, float64_solution, "float64 with the edge case out of the visible ones")


# --- exercise 2: top2_l_aux ---------------------------------------------------------------------------------------

def honest_top2_l_aux(logits):
    probs = torch.softmax(logits.float(), dim=-1)                            # (S, E)
    E = probs.shape[1]
    first = torch.nn.functional.one_hot(probs.argmax(-1), E).float()         # (S, E)
    return E * E * (probs.mean(0) * first.mean(0)).mean()


def l_aux_by_hand(x, weight, counts=None):
    """Chapter 04 section 4's notebook helper (a global of the notebook): the answer, given x and the weight."""
    probs = torch.softmax(x.float() @ weight.float().t(), dim=-1)
    n_tok, n_e = probs.shape
    first = torch.nn.functional.one_hot(probs.argmax(-1), n_e).float()
    c = first.mean(0) if counts is None else counts.float() / n_tok
    return n_e * n_e * (probs.mean(0) * c).mean()


_AUX_TABLE = {_key(lg): ch04.deepspeed_top2_l_aux(lg) for lg in ch04._l_aux_visible()}


def _both_choices(lg):
    probs = torch.softmax(lg.float(), -1)
    E = lg.shape[1]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(2, -1).indices, 1.0)
    return E * E * (probs.mean(0) * chosen.mean(0)).mean()


L_AUX_CHEATS = {
    "library top2_routing": lambda lg: top2_routing(lg, 1.0, 0).l_aux,
    "sibling top1_routing": lambda lg: top1_routing(lg, 1.0, 0).l_aux,
    "sibling topk_routing": lambda lg: topk_routing(lg, 1, 1.0, 0).l_aux,
    "sibling balance_loss": lambda lg: balance_loss(torch.softmax(lg, 1), lg.argmax(1, keepdim=True)),
    "deepspeed top1gating (issue 24)": lambda lg: sharded_moe.top1gating(lg.clone(), 1.0, 0, use_rts=False)[0],
    "deepspeed top2gating": lambda lg: sharded_moe.top2gating(lg.clone(), 1.0, 0)[0],
    "deepspeed topkgating": lambda lg: sharded_moe.topkgating(lg.clone(), 1, 1.0, 0)[0],
    "the checker's reference": ch04.deepspeed_top2_l_aux,
    "lookup table": lambda lg: _AUX_TABLE.get(_key(lg), torch.tensor(1.0)),
    "notebook global l_aux_by_hand": lambda lg: l_aux_by_hand(lg, torch.eye(lg.shape[1])),
    "counts from both choices (section 4's control)": _both_choices,
    "divided by k, as topkgating": lambda lg: honest_top2_l_aux(lg) / 2,
}


def test_top2_l_aux_honest_passes():
    must_pass(ch04.check_top2_l_aux, honest_top2_l_aux, forbidden=[l_aux_by_hand])


@pytest.mark.parametrize("name", L_AUX_CHEATS)
def test_top2_l_aux_cheats_fail(name):
    must_fail(ch04.check_top2_l_aux, L_AUX_CHEATS[name], name, forbidden=[l_aux_by_hand])
