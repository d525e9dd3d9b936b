"""Red team for chapter 06's exercise checkers (labbook.checkers.ch06): per exercise the honest solution
passes, and the library function, its siblings in labutils and DeepSpeed, a lookup table of the visible cases, a
notebook global and the chapter's known wrong answers fail: for the dispatch bytes, the capacity rounded in float64
(the chapter's old solution, issue 30), by ``int()`` or ``round()``, or as an exact fraction."""
import math
import types
from fractions import Fraction

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch06
from labutils.collectives import AllGatherFunction
from labutils.ds import import_deepspeed
from labutils.ds.gating import ds_capacity, exact_capacity
from labutils.moe import traffic
from labutils.moe.expert_parallel import local_order
from labutils.moe.functions import count_by_gate

import_deepspeed()
from deepspeed.moe import sharded_moe  # noqa: E402


def _key(*tensors):
    return tuple((tuple(t.shape), tuple(t.reshape(-1).tolist())) for t in tensors)


# --- exercise 1: all_gather_backward -----------------------------------------------------------------------------

def honest_all_gather_backward(upstream, sizes, rank, mode):                 # the notebook's solution
    grad = torch.stack(upstream).sum(0) if mode == "sum" else upstream[rank]
    return grad.split(list(sizes))[rank]


def _library_backward(upstream, sizes, rank, mode):
    ctx = types.SimpleNamespace(grad=mode, sizes=list(sizes), dim=0, group=None)
    return AllGatherFunction.backward(ctx, upstream[rank], None)[0]


_GATHER_TABLE = {_key(*c[0]) + (c[2], c[3]): ch06.all_gather_backward_reference(*c) for c in ch06._gather_visible()}

GATHER_CHEATS = {
    "library AllGatherFunction.backward": _library_backward,
    "the checker's reference": ch06.all_gather_backward_reference,
    "lookup table": lambda up, sizes, rank, mode: _GATHER_TABLE[_key(*up) + (rank, mode)],
    "always the own slice": lambda up, sizes, rank, mode: up[rank].split(list(sizes))[rank],
    "always the sum": lambda up, sizes, rank, mode: torch.stack(up).sum(0).split(list(sizes))[rank],
    "sum over ranks of the whole gradient, no slice": lambda up, sizes, rank, mode: torch.stack(up).sum(0),
}


def test_all_gather_backward_honest_passes():
    must_pass(ch06.check_all_gather_backward, honest_all_gather_backward)


@pytest.mark.parametrize("name", GATHER_CHEATS)
def test_all_gather_backward_cheats_fail(name):
    must_fail(ch06.check_all_gather_backward, GATHER_CHEATS[name], name)


# --- exercise 2: my_local_order ----------------------------------------------------------------------------------

def honest_local_order(global_expert_count, num_expert):                     # the notebook's solution
    starts = torch.cumsum(global_expert_count, 0) - global_expert_count
    world = global_expert_count.numel() // num_expert
    pieces = [torch.arange(int(starts[s * num_expert + e]), int(starts[s * num_expert + e] +
                                                                global_expert_count[s * num_expert + e]))
              for e in range(num_expert) for s in range(world)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _blocks(gec, ne):
    world = gec.numel() // ne
    block = torch.repeat_interleave(torch.arange(gec.numel()), gec)           # (N,) block of each received row
    return world, block // ne, block % ne


def _via_count_by_gate(gec, ne):
    world, src, expert = _blocks(gec, ne)
    return count_by_gate((expert * world + src).view(-1, 1), ne * world)[0]


def _sources_reversed(gec, ne):
    world, src, expert = _blocks(gec, ne)
    return torch.argsort(expert * world + (world - 1 - src), stable=True)


NOTEBOOK_PERM = local_order(torch.tensor([2, 1, 0, 3, 1, 1]), 2)              # the global of section 3's cell
_ORDER_TABLE = {_key(torch.tensor(c)) + (ne,): ch06.local_order_reference(torch.tensor(c), ne)
                for c, ne in ch06.LOCAL_ORDER_VISIBLE}

ORDER_CHEATS = {
    "library local_order": local_order,
    "sibling count_by_gate on (expert, source) keys": _via_count_by_gate,
    "the checker's reference": ch06.local_order_reference,
    "lookup table": lambda gec, ne: _ORDER_TABLE[_key(gec) + (ne,)],
    "notebook global perm": lambda gec, ne: NOTEBOOK_PERM,
    "arrival order (no regrouping)": lambda gec, ne: torch.arange(int(gec.sum())),
    "grouped by expert, sources in reverse order": _sources_reversed,
}


def test_local_order_honest_passes():
    must_pass(ch06.check_my_local_order, honest_local_order)


@pytest.mark.parametrize("name", ORDER_CHEATS)
def test_local_order_cheats_fail(name):
    must_fail(ch06.check_my_local_order, ORDER_CHEATS[name], name)


# --- exercise 3: ds_dispatch_bytes ------------------------------------------------------------------------------

def honest_ds_dispatch_bytes(tokens, E, W, d, elem, cf, k):                   # the notebook's solution
    factor = torch.tensor(cf * k)                                             # float32, as DeepSpeed's _capacity
    capacity = max(int(torch.ceil((tokens / E) * factor)), 4)
    return torch.tensor(E * capacity * d * elem * (W - 1) // W)


def _float32_capacity(t, e, cf, k):
    return int(torch.ceil((t / e) * torch.tensor(cf * k)))


def _with_capacity(capacity_of):
    return lambda tokens, E, W, d, elem, cf, k: E * max(capacity_of(tokens, E, cf, k), 4) * d * elem * (W - 1) // W


float64_solution = _with_capacity(lambda t, e, cf, k: math.ceil(t / e * cf * k))   # chapter 06's old solution
NOTEBOOK_DS = {1.0: traffic.deepspeed_bytes(48, 16, 8, 16, 4, 1.0, top_k=2),        # section 4's `ds` global
               2.0: traffic.deepspeed_bytes(48, 16, 8, 16, 4, 2.0, top_k=2)}
_BYTES_TABLE = {c: ch06.deepspeed_dispatch_bytes(*c) for c in ch06.DISPATCH_BYTES_VISIBLE}

BYTES_CHEATS = {
    "library traffic.deepspeed_bytes": lambda t, e, w, d, el, cf, k: traffic.deepspeed_bytes(t, e, w, d, el, cf,
                                                                                            top_k=k),
    "sibling ds_capacity": _with_capacity(lambda t, e, cf, k: ds_capacity(t, e, cf, k)),
    "sibling exact_capacity": _with_capacity(lambda t, e, cf, k: exact_capacity(t, e, cf, k)),
    "deepspeed _capacity": _with_capacity(lambda t, e, cf, k: int(sharded_moe._capacity(
        torch.empty(t, e), torch.tensor(cf * k), torch.tensor(4)))),
    "the checker's reference": ch06.deepspeed_dispatch_bytes,
    "lookup table, float64 elsewhere": lambda *a: _BYTES_TABLE.get(a, float64_solution(*a)),
    "notebook global ds": lambda t, e, w, d, el, cf, k: NOTEBOOK_DS.get(cf, 0),
    "rounded in float64 (the old solution)": float64_solution,
    "int() instead of ceil": _with_capacity(lambda t, e, cf, k: int(t / e * cf * k)),
    "round() instead of ceil": _with_capacity(lambda t, e, cf, k: round(t / e * cf * k)),
    "exact fraction": _with_capacity(lambda t, e, cf, k: math.ceil(Fraction(str(cf)) * k * t / e)),
    "whole buffer, own experts included": lambda t, e, w, d, el, cf, k: e * max(_float32_capacity(t, e, cf, k), 4)
    * d * el,
    "no minimum capacity": lambda t, e, w, d, el, cf, k: e * _float32_capacity(t, e, cf, k) * d * el * (w - 1) // w,
}


def test_ds_dispatch_bytes_in_float32_passes():
    must_pass(ch06.check_ds_dispatch_bytes, honest_ds_dispatch_bytes)


@pytest.mark.parametrize("name", BYTES_CHEATS)
def test_ds_dispatch_bytes_cheats_fail(name):
    must_fail(ch06.check_ds_dispatch_bytes, BYTES_CHEATS[name], name)


def test_the_issue_example_is_visible_and_the_old_solution_misses_it():
    case = (25, 2, 2, 8, 4, 1.2, 1)                                           # issue 30: DeepSpeed 16, solution 15
    assert case in ch06.DISPATCH_BYTES_VISIBLE
    assert ch06.deepspeed_dispatch_bytes(*case) == 2 * 16 * 8 * 4 // 2 != float64_solution(*case)


def test_the_old_solution_fails_on_hidden_cases_alone(monkeypatch):
    """The float32 edge cases are drawn hidden too: without the visible ones the float64 student still fails."""
    monkeypatch.setattr(ch06, "DISPATCH_BYTES_VISIBLE", ((48, 16, 8, 16, 4, 1.0, 2),))
    must_fail(ch06.check_ds_dispatch_bytes, float64_solution, "float64 with only an easy visible case")
