"""Pins for ``labutils/moe/balance_gates.py`` (issue 38: the mutants its other tests left alive).

The constructors' arguments and defaults, the exact error texts, the ``group`` each collective and helper gets,
the device of ZeroGate's outputs, and SWIPE over 2 to 4 threaded ranks (one process) against a brute-force loop
written here: each worker accepts incoming choices in rank order up to its room, the refused ones go, source by
source, to the first workers with room left, to local expert ``bias`` there; the first accepted choices of each
(source, destination) stay. Several of the cases run in two process groups of 2 ranks inside a 4-rank world, so
a collective or ``get_rank`` on the default group instead of the gate's ``group`` gives other numbers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks
from torch import nn

from labutils.moe import DCGate, SwipeGate, ZeroGate, balance_gates

D = 4


# ---- a brute-force SWIPE round ------------------------------------------------------------------------------------
class Refused(Exception):
    pass


def swipe_loop(idx, ne, caps, bias):
    """One SWIPE round on every worker at once: ``idx[i]`` worker i's global expert ids, ``caps[i]`` its room.
    Returns (new ids per worker, room left per worker); raises Refused(n) when n choices find no room."""
    W = len(idx)
    room = list(caps)
    n = [[sum(1 for e in idx[i] if e // ne == w) for w in range(W)] for i in range(W)]
    acc = [[0] * W for _ in range(W)]
    for w in range(W):
        for i in range(W):
            acc[i][w] = min(n[i][w], room[w])
            room[w] -= acc[i][w]
    refused = [sum(n[i]) - sum(acc[i]) for i in range(W)]
    if sum(refused) > sum(room):
        raise Refused(sum(refused) - sum(room))
    moved = [[0] * W for _ in range(W)]
    for i in range(W):
        for w in range(W):
            m = min(refused[i], room[w])
            moved[i][w], refused[i], room[w] = m, refused[i] - m, room[w] - m
    out = []
    for i in range(W):
        left = list(acc[i])
        targets = [w for w in range(W) for _ in range(moved[i][w])]
        new = []
        for e in idx[i]:
            w = e // ne
            if left[w] > 0:
                left[w] -= 1
                new.append(e)
            else:
                new.append(targets.pop(0) * ne + bias)
        assert not targets
        out.append(new)
    return out, room


def _swipe_ranks(cases, ne, pairs):
    """On each rank: ``swipe_once`` of its case. ``pairs``: two groups {0,1} and {2,3} in a 4-rank world."""
    r = dist.get_rank()
    if pairs:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, case, rr = groups[r // 2], cases[r // 2], r % 2
    else:
        group, case, rr = None, cases[0], r
    idx, caps, bias = case
    gate = SwipeGate(D, ne, len(idx), group=group)
    new, cap = gate.swipe_once(torch.tensor(idx[rr], dtype=torch.int64), torch.tensor(caps[rr]), bias)
    return new.tolist(), cap.item(), cap.dtype, cap.shape


# (idx per worker, room per worker, bias), experts per worker `ne`
CASES = {
    # worker 0 full after rank 0: all 5 of rank 1's choices refused (more than half), 1 of rank 0's; bias 1
    "two_workers_most_refused": (2, ([[0, 1, 0, 2, 1, 0], [1, 0, 0, 1, 0]], [5, 20], 1)),
    # two sources into worker 1 (its room shared in rank order), 1 refused choice left at the end
    "two_sources_share_room": (2, ([[2, 3, 2, 0], [3, 2, 1, 2]], [4, 5], 0)),
    # worker 0 has room; worker 1 refuses; the refused go to worker 0 first
    "room_on_worker_zero": (1, ([[1, 1, 1], [1, 0, 1]], [4, 2], 0)),
    # nothing refused; the last worker receives nothing
    "no_refusal": (3, ([[0, 1, 2], [2, 1]], [9, 9], 2)),
    # the refused choices exactly fill worker 0's room
    "exact_fill": (2, ([[2, 2, 2], [3, 3, 0]], [4, 2], 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_swipe_once_on_two_ranks_matches_the_loop(name):
    ne, case = CASES[name]
    want, room = swipe_loop(*case[:1], ne, *case[1:])
    got = run_ranks(_swipe_ranks, 2, [case], ne, False)
    assert [g[0] for g in got] == want
    assert [g[1] for g in got] == room
    assert all(g[2] == torch.int64 and g[3] == () for g in got)


THREE = [
    # three workers of 1 expert: workers 0 and 1 full, worker 2's room takes all the refused (j advances twice)
    ([[0, 0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 0]], [2, 2, 20], 0),
    # the refused go to worker 1 then worker 2 (worker 0 full)
    ([[0, 0, 0, 0], [0, 0, 2], [0, 0, 0]], [1, 3, 6], 0),
    # worker 1 full, worker 0 and 2 have room: worker 0 first, then 2
    ([[1, 1, 1, 1], [1, 1, 1], [1, 1, 2]], [2, 1, 30], 0),
    # a source whose refused choices span worker 0's last slot and worker 2's room, ending with exactly 1 left
    ([[1, 1, 1], [1, 1, 1], [1, 1, 1]], [1, 2, 8], 0),
]


def _three_ranks(case):
    idx, caps, bias = case
    gate = SwipeGate(D, 1, 3)
    r = dist.get_rank()
    new, cap = gate.swipe_once(torch.tensor(idx[r]), torch.tensor(caps[r]), bias)
    return new.tolist(), int(cap)


@pytest.mark.parametrize("case", THREE, ids=range(len(THREE)))
def test_swipe_once_on_three_ranks_matches_the_loop(case):
    want, room = swipe_loop(case[0], 1, case[1], case[2])
    got = run_ranks(_three_ranks, 3, case)
    assert [g[0] for g in got] == want and [g[1] for g in got] == room


def test_swipe_once_random_rounds_on_three_and_four_ranks():
    """Seeded random ids and rooms (some rounds refuse more than there is room: the error, on every rank)."""
    gen = torch.Generator().manual_seed(7)
    ran = refused = 0
    for W, ne in ((3, 2), (4, 1), (4, 2), (3, 1)):
        for _ in range(4):
            idx = [torch.randint(0, W * ne, (int(torch.randint(0, 7, (), generator=gen)),), generator=gen).tolist()
                   for _ in range(W)]
            caps = torch.randint(0, 8, (W,), generator=gen).tolist()
            bias = int(torch.randint(0, ne, (), generator=gen))
            try:
                want = swipe_loop(idx, ne, caps, bias)
            except Refused as r:
                with pytest.raises(RuntimeError) as err:
                    run_ranks(_w_ranks, W, ne, (idx, caps, bias))
                assert str(err.value) == (f"SwipeGate: {r.args[0]} refused choices but no capacity left on any "
                                          "worker (the workers' batch sizes differ too much)")
                refused += 1
                continue
            got = run_ranks(_w_ranks, W, ne, (idx, caps, bias))
            assert [g[0] for g in got] == want[0] and [g[1] for g in got] == want[1], (W, ne, idx, caps)
            ran += 1
    assert ran >= 8 and refused >= 2


def _w_ranks(ne, case):
    idx, caps, bias = case
    r = dist.get_rank()
    new, cap = SwipeGate(D, ne, len(idx)).swipe_once(torch.tensor(idx[r], dtype=torch.int64),
                                                    torch.tensor(caps[r]), bias)
    return new.tolist(), int(cap)


def test_swipe_once_uses_the_gates_group_in_a_larger_world():
    """Two independent pairs {0,1} and {2,3}: each pair's result is its own loop's (the default group has 4)."""
    a = ([[0, 1, 0, 2, 1, 0], [1, 0, 0, 1, 0]], [5, 20], 1)
    b = ([[2, 3, 2, 0], [3, 2, 1, 2]], [4, 5], 0)
    got = run_ranks(_swipe_ranks, 4, [a, b], 2, True)
    wa, ra = swipe_loop(a[0], 2, a[1], a[2])
    wb, rb = swipe_loop(b[0], 2, b[1], b[2])
    assert [g[0] for g in got] == wa + wb
    assert [g[1] for g in got] == ra + rb


def test_too_many_refused_choices_raise_the_full_text():
    case = ([[0, 0, 0, 1], [0, 1, 1]], [2, 1], 0)           # 7 choices, 3 slots: 4 refused, 0 room left
    with pytest.raises(Refused):
        swipe_loop(case[0], 2, case[1], 0)
    with pytest.raises(RuntimeError) as err:
        run_ranks(_swipe_ranks, 2, [case], 2, False)
    assert str(err.value) == ("SwipeGate: 4 refused choices but no capacity left on any worker (the workers' batch "
                              "sizes differ too much)")


def test_one_worker_with_too_little_room_raises_the_full_text():
    gate = SwipeGate(D, 3)
    with pytest.raises(RuntimeError) as err:
        gate.swipe_once(torch.tensor([0, 1, 2, 0, 1]), torch.tensor(3, dtype=torch.int64), 0)
    assert str(err.value) == ("SwipeGate: 2 refused choices but no capacity left on any worker (the workers' batch "
                              "sizes differ too much)")


def test_one_worker_swipe_once_keeps_the_ids_and_spends_the_room():
    new, cap = SwipeGate(D, 3).swipe_once(torch.tensor([2, 1, 2]), torch.tensor(5, dtype=torch.int64), 1)
    assert new.tolist() == [2, 1, 2] and cap.item() == 2 and cap.dtype == torch.int64


# ---- _share ------------------------------------------------------------------------------------------------------
BIG = 2 ** 24 + 1     # not a float32: a room gathered through a float tensor comes back as 2**24


def _share_ranks(drops, caps):
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gate = SwipeGate(D, 2, 2, group=groups[r // 2])
    total, gcap = gate._share(list(drops[r]), caps[r])
    return total, gcap


def test_share_sums_the_refused_and_gathers_the_rooms_within_the_group():
    drops = [[1, 2], [10, 20], [100, 200], [1000, 2000]]
    caps = [BIG, 3, 5, BIG + 2]
    got = run_ranks(_share_ranks, 4, drops, caps)
    assert got[0] == got[1] == ([11, 22], [BIG, 3])
    assert got[2] == got[3] == ([1100, 2200], [5, BIG + 2])
    assert all(type(c) is int for c in got[0][1])


def _share_size_mismatch():
    gate = SwipeGate(D, 2, 2)
    return gate._share([0, 0], 1)


def test_share_checks_the_group_size_naming_the_gate():
    with pytest.raises(ValueError) as err:
        run_ranks(_share_size_mismatch, 3)
    assert str(err.value) == "SwipeGate: world_size=2, but the process group has 3 ranks"


def test_share_without_a_process_group_names_the_gate():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as err:
        SwipeGate(D, 2, 2)._share([0, 0], 1)
    assert str(err.value).startswith("SwipeGate needs a process group, but torch.distributed is not initialised")


# ---- SwipeGate: constructor and forward ------------------------------------------------------------------------
def test_swipe_gate_defaults_and_arguments():
    g = SwipeGate(D, 4)
    assert (g.world_size, g.tot_expert, g.top_k, g.group) == (1, 4, 2, None)
    assert g.gate.bias is not None
    assert SwipeGate(D, 4, gate_bias=True).gate.bias is not None
    assert SwipeGate(D, 4, gate_bias=False).gate.bias is None
    marker = object()
    assert SwipeGate(D, 4, group=marker).group is marker


def test_swipe_gate_input_error_names_the_gate():
    with pytest.raises(ValueError) as err:
        SwipeGate(D, 4)(torch.zeros(3, D + 1))
    assert str(err.value) == f"SwipeGate(d_model={D}) got input of shape (3, {D + 1}); expected (tokens, d_model={D})"


def test_swipe_gate_eval_with_logits_fed_in_takes_top_k_over_the_last_dim():
    """A swapped-in nn.Identity (chapter 01's exercise) passes any leading shape through in eval."""
    gate = SwipeGate(D, 3, top_k=2).eval()
    gate.gate = nn.Identity()
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]], [[1.0, 0.0, 4.0], [0.2, 0.1, 0.3]]])  # (2, 2, 3)
    idx, score = gate(logits)
    want_idx = [[[1, 2], [0, 2]], [[2, 0], [2, 0]]]
    assert idx.tolist() == want_idx
    for a in range(2):
        for b in range(2):
            v = [float(logits[a, b, e]) for e in want_idx[a][b]]
            e0 = 1.0 / (1.0 + torch.exp(torch.tensor(v[1] - v[0])))
            assert torch.allclose(score[a, b], torch.stack([e0, 1 - e0]), atol=1e-6)


def _forward_ranks(xs, weight):
    r = dist.get_rank()
    gate = SwipeGate(D, 1, 2, top_k=2, gate_bias=False)
    with torch.no_grad():
        gate.gate.weight.copy_(weight)
    idx, score = gate(xs[r])
    return idx.tolist(), score.detach()


def test_swipe_gate_training_on_two_ranks_reroutes_and_scores_the_new_experts():
    """2 workers, 1 expert each, top-2: every token picks both; each worker's room is T*k of its own tokens."""
    weight = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    xs = [torch.tensor([[2.0, 1.0, 0, 0], [3.0, 0.0, 0, 0], [0.0, 1.0, 0, 0]]),
          torch.tensor([[1.0, 0.5, 0, 0]])]
    got = run_ranks(_forward_ranks, 2, xs, weight)
    choices = [[[0, 1], [0, 1], [1, 0]], [[0, 1]]]
    room = [6, 2]
    want = [[list(row) for row in c] for c in choices]
    for j in range(2):
        col, room = swipe_loop([[row[j] for row in c] for c in choices], 1, room, j % 1)
        for r in range(2):
            for t in range(len(choices[r])):
                want[r][t][j] = col[r][t]
    for r in range(2):
        assert got[r][0] == want[r]
        logits = xs[r] @ weight.t()
        vals = torch.stack([logits[t, want[r][t]] for t in range(len(want[r]))])
        assert torch.allclose(got[r][1], torch.softmax(vals, -1), atol=1e-6)


def test_swipe_gate_training_with_no_tokens():
    gate = SwipeGate(D, 3).train()
    idx, score = gate(torch.zeros(0, D))
    assert idx.shape == (0, 2) and score.shape == (0, 2)


# ---- ZeroGate ----------------------------------------------------------------------------------------------------
def test_zero_gate_defaults():
    g = ZeroGate(D, 4)
    assert (g.world_size, g.tot_expert, g.top_k, g.d_model) == (1, 4, 2, D)


def test_zero_gate_input_error_names_the_gate():
    with pytest.raises(ValueError) as err:
        ZeroGate(D, 4)(torch.zeros(3, D + 2))
    assert str(err.value) == f"ZeroGate(d_model={D}) got input of shape (3, {D + 2}); expected (tokens, d_model={D})"


def test_zero_gate_outputs_on_the_inputs_device():
    """The meta device stands in for a GPU: both outputs follow the input's device, not the default one."""
    idx, score = ZeroGate(D, 4, top_k=3)(torch.empty(5, D, device="meta"))
    assert idx.device.type == "meta" and idx.shape == (15,) and idx.dtype == torch.int64
    assert score.device.type == "meta" and score.shape == (5, 1, 3)


# ---- DCGate ------------------------------------------------------------------------------------------------------
def test_dc_gate_defaults_and_arguments_reach_gshard():
    g = DCGate(D, 4)
    assert (g.world_size, g.top_k, g.capacity, g.group) == (1, 2, (1.2, 2.4), None)
    assert g.random_routing is True and g.gate.bias is not None
    g = DCGate(D, 4, random_routing=False)
    assert g.random_routing is False and g.gate.bias is not None
    assert DCGate(D, 4, gate_bias=False).gate.bias is None
    assert DCGate(D, 4, top_k=1, topk=2).top_k == 2
    with pytest.raises(ValueError, match="top-2 gate; got top_k=3"):
        DCGate(D, 4, topk=3)
    marker = object()
    assert DCGate(D, 4, group=marker).group is marker


def test_dc_gate_passes_its_group_to_limit_by_capacity(monkeypatch):
    seen = []
    real = balance_gates.limit_by_capacity

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **{**kwargs, "group": None})

    monkeypatch.setitem(vars(balance_gates), "limit_by_capacity", spy)
    marker = object()
    gate = DCGate(D, 4, capacity=(0.5, 0.5), random_routing=False, group=marker)
    gate(torch.randn(6, D))
    assert len(seen) == 1
    assert seen[0]["group"] is marker and seen[0]["world_size"] == 1 and seen[0]["capacity"] == 3
