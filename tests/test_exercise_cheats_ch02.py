"""Red team for chapter 02's exercise checkers (labbook.checkers.ch02): per exercise the honest solution
passes, and the library function, its siblings in labutils and DeepSpeed, a lookup table of the visible cases, the
notebook globals that held answers, and the chapter's known wrong answers (a capacity rounded in float64 or exactly)
fail."""
import math
from fractions import Fraction

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch02
from labutils.ds import import_deepspeed
from labutils.ds.gating import Routing, ds_capacity, exact_capacity, top1_routing, top2_routing, topk_routing
from labutils.moe.modern.losses import balance_loss

import_deepspeed()
from deepspeed.moe import sharded_moe  # noqa: E402
from deepspeed.moe.sharded_moe import TopKGate  # noqa: E402


def _key(*args):
    return tuple((tuple(a.shape), tuple(a.reshape(-1).tolist())) if torch.is_tensor(a) else a for a in args)


# --- exercise 1: capacity -----------------------------------------------------------------------------------------

def honest_capacity(S, E, cf, k, min_capacity):
    c = torch.ceil((S / E) * torch.tensor(cf * k)).to(torch.int64)          # DeepSpeed multiplies in float32
    return torch.maximum(c, torch.tensor(min_capacity))


def honest_capacity_explicit_float32(S, E, cf, k, min_capacity):
    per_expert = torch.tensor(S / E, dtype=torch.float32)
    return max(min_capacity, int(torch.ceil(per_expert * torch.tensor(cf * k, dtype=torch.float32))))


_CAP_TABLE = {c[:4]: ch02.deepspeed_capacity(*c) for c in ch02.CAPACITY_VISIBLE}


def _real_gate_capacity(S, E, cf, k, m):
    gate = TopKGate(4, E, k=k, capacity_factor=cf, min_capacity=m, use_rts=False, top2_2nd_expert_sampling=False)
    return int(gate(torch.randn(S, 4), None, True)[1])


CAPACITY_CHEATS = {
    "library ds_capacity": lambda S, E, cf, k, m: ds_capacity(S, E, cf, k, m),
    "deepspeed _capacity": lambda S, E, cf, k, m: sharded_moe._capacity(torch.empty(S, E), torch.tensor(cf * k),
                                                                      torch.tensor(m)),
    "deepspeed TopKGate": _real_gate_capacity,
    "sibling exact_capacity": lambda S, E, cf, k, m: exact_capacity(S, E, cf, k, m),
    "the checker's reference": ch02.deepspeed_capacity,
    "lookup table, float64 elsewhere": lambda S, E, cf, k, m: _CAP_TABLE.get((S, E, cf, k),
                                                                              max(m, math.ceil(S / E * cf * k))),
    "rounded in float64": lambda S, E, cf, k, m: max(m, math.ceil(S / E * cf * k)),
    "float64, factor first": lambda S, E, cf, k, m: max(m, math.ceil(cf * k * S / E)),
    "exact fraction": lambda S, E, cf, k, m: max(m, math.ceil(Fraction(str(cf)) * k * S / E)),
}


@pytest.mark.parametrize("fn", [honest_capacity, honest_capacity_explicit_float32], ids=["solution", "float32"])
def test_capacity_in_float32_passes(fn):
    must_pass(ch02.check_my_capacity, fn)


@pytest.mark.parametrize("name", CAPACITY_CHEATS)
def test_capacity_cheats_fail(name):
    must_fail(ch02.check_my_capacity, CAPACITY_CHEATS[name], name)


def test_capacity_edge_cases_are_real_deepspeed_disagreements():
    f64_edges, exact_edges = ch02.capacity_edge_candidates()
    assert (100, 4, 1.2, 1) in f64_edges and len(f64_edges) > 100 and len(exact_edges) > 100
    assert ch02.deepspeed_capacity(100, 4, 1.2, 1, 0) == 31 == _real_gate_capacity(100, 4, 1.2, 1, 0)
    gen = torch.Generator().manual_seed(0)
    for i in range(9):
        S, E, cf, k, m = ch02.capacity_case(gen, i)
        ds = ch02.deepspeed_capacity(S, E, cf, k, m)
        if i % 3 == 0:
            assert ds != math.ceil(S / E * cf * k), (S, E, cf, k)
        elif i % 3 == 1:
            assert ds != math.ceil(Fraction(str(cf)) * k * S / E), (S, E, cf, k)
        if i < 3:  # the real gate returns the reference's capacity (top-1 asserts S >= min_capacity)
            assert _real_gate_capacity(S, E, cf, k, 0) == ds


# --- exercise 2: top-1 l_aux --------------------------------------------------------------------------------------

def honest_top1_l_aux(logits):
    probs = torch.softmax(logits.float(), dim=1)                              # (S, E)
    first = torch.nn.functional.one_hot(probs.argmax(1), logits.shape[1]).float()
    return (probs.mean(0) * first.mean(0)).sum() * logits.shape[1]


_AUX_TABLE = {_key(lg): ch02.deepspeed_top1_l_aux(lg) for lg in ch02._l_aux_visible()}


def _top2_style(logits):  # the top-2 formula on top-1 choices: the same number by hand, allowed
    probs = torch.softmax(logits.float(), dim=1)
    first = torch.nn.functional.one_hot(probs.argmax(1), logits.shape[1]).float()
    return (probs.mean(0) * first.mean(0)).mean() * logits.shape[1] ** 2


L_AUX_CHEATS = {
    "library top1_routing": lambda lg: top1_routing(lg, 1.0, 0).l_aux,
    "sibling top2_routing": lambda lg: top2_routing(lg, 1.0, 0).l_aux,
    "sibling topk_routing": lambda lg: topk_routing(lg, 1, 1.0, 0).l_aux,
    "sibling balance_loss": lambda lg: balance_loss(torch.softmax(lg, 1), lg.argmax(1, keepdim=True)),
    "deepspeed top1gating": lambda lg: sharded_moe.top1gating(lg.clone(), 1.0, 0, use_rts=False)[0],
    "deepspeed top2gating": lambda lg: sharded_moe.top2gating(lg.clone(), 1.0, 0, top2_2nd_expert_sampling=False)[0],
    "deepspeed topkgating": lambda lg: sharded_moe.topkgating(lg.clone(), 1, 1.0, 0)[0],
    "the checker's reference": ch02.deepspeed_top1_l_aux,
    "lookup table": lambda lg: _AUX_TABLE.get(_key(lg), torch.tensor(1.0)),
    "missing a factor E": lambda lg: honest_top1_l_aux(lg) / lg.shape[1],
    "counts from both top-2 choices": lambda lg: (torch.softmax(lg, 1).mean(0) * torch.zeros_like(lg).scatter_(
        1, lg.topk(min(2, lg.shape[1]), 1).indices, 1.0).mean(0)).sum() * lg.shape[1],
}


@pytest.mark.parametrize("fn", [honest_top1_l_aux, _top2_style], ids=["solution", "mean-times-E-squared"])
def test_top1_l_aux_by_hand_passes(fn):
    must_pass(ch02.check_my_top1_l_aux, fn)


@pytest.mark.parametrize("name", L_AUX_CHEATS)
def test_top1_l_aux_cheats_fail(name):
    must_fail(ch02.check_my_top1_l_aux, L_AUX_CHEATS[name], name)


# --- exercise 3: the dispatch buffer ------------------------------------------------------------------------------

def honest_dispatch(x, indices, locations, E, C):
    buf = x.new_zeros(E, C, x.shape[1])                                       # (E, C, d)
    kept = indices >= 0
    token = torch.arange(x.shape[0]).expand_as(indices)
    buf[indices[kept], locations[kept]] = x[token[kept]]
    return buf


def _unmasked(x, indices, locations, E, C):  # forgets the -1 of a dropped route: it lands in the last expert
    buf = x.new_zeros(E, C, x.shape[1])
    for j in range(indices.shape[0]):
        buf[indices[j], locations[j]] = x
    return buf


def _with_routing(x, indices, locations, E, C):
    r = Routing(indices, locations, torch.ones(indices.shape), C, torch.zeros(E, dtype=torch.long), torch.tensor(0.0),
                E)
    return torch.einsum("sec,sd->ecd", r.dispatch_mask().float(), x)


def _sparse_encode(x, indices, locations, E, C):
    return sharded_moe._sparse_encode(x, sharded_moe._route_slots(indices, locations, E, C), E, C)


@pytest.fixture(scope="module")
def notebook_globals():
    """What the old notebook cell left in its globals: ``real_buffers`` (id(x) -> the real buffer) for its visible
    cases, and section 3's recorded ``received`` buffer; a student reading them in a later cell."""
    real_buffers = {}
    for settings in ch02.DISPATCH_VISIBLE:
        case, layer = ch02.real_dispatch(*settings)
        real_buffers[_key(case[0])] = ch02.experts_input(layer, case[0])
    case, layer = ch02.real_dispatch(2, 12, 16, 4, 1, 1.0)
    received = [ch02.experts_input(layer, case[0])[None]]
    return real_buffers, received


def test_dispatch_honest_passes():
    must_pass(ch02.check_my_dispatch, honest_dispatch)


@pytest.mark.parametrize("name", ["library Routing.dispatch_mask", "deepspeed _sparse_encode", "lookup table",
                                  "notebook global real_buffers", "notebook global received",
                                  "dropped routes not masked"])
def test_dispatch_cheats_fail(name, notebook_globals):
    real_buffers, received = notebook_globals
    cheats = {
        "library Routing.dispatch_mask": _with_routing,
        "deepspeed _sparse_encode": _sparse_encode,
        "lookup table": lambda x, *rest: real_buffers.get(_key(x), honest_dispatch(x, *rest) * 0),
        "notebook global real_buffers": lambda x, *rest: real_buffers[_key(x)],
        "notebook global received": lambda x, *rest: received[0][0],
        "dropped routes not masked": _unmasked,
    }
    must_fail(ch02.check_my_dispatch, cheats[name], name, n_hidden=2)  # each hidden case is a fresh MoE run


def test_the_real_layer_run_by_the_student_is_off_limits():
    from deepspeed.moe.layer import MoE

    def run_the_layer(x, indices, locations, E, C):
        layer = MoE(x.shape[1], torch.nn.Linear(x.shape[1], x.shape[1]), num_experts=E, k=indices.shape[0])
        seen = []
        layer.deepspeed_moe.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0]))
        layer(x)
        return seen[0]

    must_fail(ch02.check_my_dispatch, run_the_layer, "building a DeepSpeed MoE layer inside the answer", n_hidden=1)
