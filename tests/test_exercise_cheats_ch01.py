"""Red team for chapter 01's exercise checkers (labbook.checkers.ch01): per exercise the honest solution
passes, and the library function, a sibling in labutils that computes the same thing, a lookup table of the
visible cases, and the chapter's known wrong answers fail."""
import math

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch01
from labutils.moe import FMoETransformerMLP, NaiveGate, SwitchGate, count_by_gate, drop_over_capacity
from labutils.moe.capacity import limit_by_capacity, position_in_expert
from labutils.moe.fastmoe import api as fastmoe_api
from labutils.moe.modern.losses import balance_loss
from labutils.moe.reference import reference_moe


def _key(t):
    return (tuple(t.shape), tuple(t.reshape(-1).tolist()))


# --- my_moe_forward -----------------------------------------------------------------------------------------------

def honest_moe(x, w_gate, b_gate, W1, b1, W2, b2, k):
    top_val, top_idx = torch.topk(x @ w_gate.T + b_gate, k, dim=-1)        # (T, k)
    score = torch.softmax(top_val, dim=-1)
    y = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.nonzero(top_idx == e, as_tuple=True)
        hid = torch.nn.functional.gelu(x[tok] @ W1[e].T + b1[e])
        y = y.index_add(0, tok, score[tok, slot, None] * (hid @ W2[e].T + b2[e]))
    return y


def _layer_with(w_gate, b_gate, W1, b1, W2, b2, k):
    layer = FMoETransformerMLP(num_expert=w_gate.shape[0], d_model=w_gate.shape[1], d_hidden=W1.shape[1], top_k=k)
    with torch.no_grad():
        layer.gate.gate.weight.copy_(w_gate)
        layer.gate.gate.bias.copy_(b_gate)
        for e, ex in enumerate(layer.experts):  # pyright: ignore[reportArgumentType]
            for lin, w, b in ((ex.htoh4, W1, b1), (ex.h4toh, W2, b2)):
                lin.weight.copy_(w[e:e + 1])
                lin.bias.copy_(b[e:e + 1])
    return layer


def moe_library(x, *w):
    return _layer_with(*w)(x).detach()


def moe_general_forward(x, w_gate, b_gate, W1, b1, W2, b2, k):  # the cheat that passed before
    top_val, idx = torch.topk(x @ w_gate.T + b_gate, k, dim=-1)
    score = torch.softmax(top_val, dim=-1)
    E = w_gate.shape[0]

    def experts(inp, counts):
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            rows = inp[start:start + n]
            out.append(torch.nn.functional.gelu(rows @ W1[e].T + b1[e]) @ W2[e].T + b2[e])
            start += n
        return torch.cat(out)

    y = fastmoe_api._fmoe_general_global_forward(x, idx, experts, E, 1)     # (T*k, d)
    return (score.unsqueeze(1) @ y.view(-1, k, x.shape[1])).squeeze(1)


def moe_reference_moe(x, w_gate, b_gate, W1, b1, W2, b2, k):
    return reference_moe(_layer_with(w_gate, b_gate, W1, b1, W2, b2, k), x).detach()


MOE_TABLE = {_key(c[0]): ch01.moe_forward_reference(*c).float() for c in ch01.moe_visible()}


def moe_softmax_over_all(x, w_gate, b_gate, W1, b1, W2, b2, k):  # SwitchGate's scores, not the top-k softmax
    top_p, top_idx = torch.topk(torch.softmax(x @ w_gate.T + b_gate, dim=-1), k, dim=-1)
    y = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.nonzero(top_idx == e, as_tuple=True)
        hid = torch.nn.functional.gelu(x[tok] @ W1[e].T + b1[e])
        y = y.index_add(0, tok, top_p[tok, slot, None] * (hid @ W2[e].T + b2[e]))
    return y


def test_my_moe_forward_honest_passes():
    must_pass(ch01.check_my_moe_forward, honest_moe)


@pytest.mark.parametrize("cheat", [moe_library, moe_general_forward, moe_reference_moe,
                                   lambda x, *w: MOE_TABLE[_key(x)], moe_softmax_over_all],
                         ids=["FMoETransformerMLP", "_fmoe_general_global_forward", "reference_moe", "lookup-table",
                              "softmax-over-all-E"])
def test_my_moe_forward_cheats_fail(cheat):
    must_fail(ch01.check_my_moe_forward, cheat)


# --- my_switch_loss -------------------------------------------------------------------------------------------------

def honest_switch(logits):
    E = logits.shape[1]
    probs = torch.softmax(logits, dim=-1)
    f = torch.bincount(logits.argmax(-1), minlength=E).float() / logits.shape[0]
    return E * (f * probs.mean(0)).sum()


def switch_balance_loss(logits):  # the cheat that passed before (chapter 09's loss, same number at k = 1)
    return balance_loss(torch.softmax(logits, -1), logits.argmax(-1, keepdim=True))


def switch_gate_cheat(logits):  # the lab's SwitchGate on an identity router, capacity large enough for no drops
    E = logits.shape[1]
    gate = SwitchGate(E, E, capacity=(100.0, 100.0)).eval()
    with torch.no_grad():
        gate.gate.weight.copy_(torch.eye(E))
        gate.gate.bias.zero_()
    gate(logits)
    return gate.get_loss()


def switch_after_drop(logits):  # fastmoe's formula after dropping at capacity ceil(T / E): not §0's definition
    T, E = logits.shape
    probs = torch.softmax(logits, -1)
    cap, load, kept = math.ceil(T / E), [0] * E, []
    for e in logits.argmax(-1).tolist():
        if load[e] < cap:
            load[e] += 1
            kept.append(e)
    frac = torch.bincount(torch.tensor(kept), minlength=E).float() / len(kept)
    return E * (frac * probs.sum(0) / len(kept)).sum()


SWITCH_TABLE = {_key(c[0]): ch01.switch_loss_reference(*c) for c in ch01.switch_visible()}


def test_my_switch_loss_honest_passes():
    must_pass(ch01.check_my_switch_loss, honest_switch)


def p_squared(logits):  # E * sum P_e^2: uses the probabilities twice, no counts
    return logits.shape[1] * (torch.softmax(logits, -1).mean(0) ** 2).sum()


@pytest.mark.parametrize("cheat", [switch_balance_loss, switch_gate_cheat, lambda lg: SWITCH_TABLE[_key(lg)],
                                   switch_after_drop, p_squared],
                         ids=["router_losses.balance_loss", "SwitchGate", "lookup-table", "fastmoe-after-drop",
                              "P-squared"])
def test_my_switch_loss_cheats_fail(cheat):
    must_fail(ch01.check_my_switch_loss, cheat)


def test_the_sibling_cheats_compute_the_right_number_so_only_the_guard_stops_them():
    (logits,) = ch01.switch_visible()[0]
    want = ch01.switch_loss_reference(logits)
    for cheat in (switch_balance_loss, switch_gate_cheat):
        value = cheat(logits)
        assert value is not None and abs(float(value.detach()) - float(want)) < 1e-5


# --- count_by_gate --------------------------------------------------------------------------------------------------

def honest_count(gate_idx, num_expert):
    flat = gate_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_expert)
    pos = torch.argsort(key, stable=True)[: int((flat >= 0).sum())]
    return pos, torch.bincount(flat[flat >= 0], minlength=num_expert)


COUNT_TABLE = {_key(c[0]): ch01.count_by_gate_reference(*c) for c in ch01.count_visible()}


def test_count_by_gate_honest_passes():
    must_pass(ch01.check_count_by_gate, honest_count)


@pytest.mark.parametrize("cheat", [
    lambda g, e: count_by_gate(g, e),                                          # labutils.moe.count_by_gate
    lambda g, e: fastmoe_api.count_by_gate(g, e, 1)[:2],                        # fastmoe's (pos, lec, gec)
    lambda g, e: fastmoe_api.prepare_forward(g, e, 1)[:2],                      # a sibling
    lambda g, e: COUNT_TABLE[_key(g)],                                          # lookup table
    lambda g, e: (torch.argsort(g.reshape(-1).clamp_min(0), stable=True),       # -1 counted as expert 0
                  torch.bincount(g.reshape(-1).clamp_min(0), minlength=e)),
], ids=["count_by_gate", "fastmoe_api.count_by_gate", "prepare_forward", "lookup-table", "drops-counted"])
def test_count_by_gate_cheats_fail(cheat):
    must_fail(ch01.check_count_by_gate, cheat)


# --- top-k gate -------------------------------------------------------------------------------------------------------

def honest_topk(logits, k):
    val, idx = torch.topk(logits, k, dim=-1)
    return idx, torch.softmax(val, dim=-1)


def _identity_gate(logits, k):
    E = logits.shape[1]
    g = NaiveGate(E, E, 1, k)
    with torch.no_grad():
        g.gate.weight.copy_(torch.eye(E))
        g.gate.bias.zero_()
    return g


TOPK_TABLE = {_key(c[0]): ch01.topk_gate_reference(*c) for c in ch01.topk_visible()}


def test_topk_gate_honest_passes():
    must_pass(ch01.check_topk_gate, honest_topk)


@pytest.mark.parametrize("cheat", [
    lambda lg, k: _identity_gate(lg, k)(lg),                                    # NaiveGate itself
    lambda lg, k: _identity_gate(lg, k).top_k_logits(lg)[:2],                   # the cheat that passed before
    lambda lg, k: TOPK_TABLE[_key(lg)],                                         # lookup table
    lambda lg, k: torch.topk(torch.softmax(lg, -1), k, -1)[::-1],               # softmax over all E
    lambda lg, k: (torch.topk(lg, k, -1, largest=False).indices, torch.softmax(torch.topk(lg, k, -1).values, -1)),
], ids=["NaiveGate", "NaiveGate.top_k_logits", "lookup-table", "softmax-over-all-E", "smallest-ids"])
def test_topk_gate_cheats_fail(cheat):
    must_fail(ch01.check_topk_gate, cheat)


# --- drop_over_capacity -----------------------------------------------------------------------------------------------

def honest_drop(gate_idx, num_expert, capacity):
    out, load = gate_idx.clone(), [0] * num_expert
    for j in range(gate_idx.shape[1]):
        for t in range(gate_idx.shape[0]):
            e = int(gate_idx[t, j])
            if e >= 0 and load[e] < capacity:
                load[e] += 1
            elif e >= 0:
                out[t, j] = -1
    return out


def via_position_in_expert(gate_idx, num_expert, capacity):  # the cheat that passed before
    rank = position_in_expert(gate_idx, num_expert)
    return torch.where((gate_idx >= 0) & (rank < capacity), gate_idx, torch.full_like(gate_idx, -1))


def token_major(gate_idx, num_expert, capacity):  # wrong order: token by token, both choices together
    out, load = gate_idx.clone(), [0] * num_expert
    for t in range(gate_idx.shape[0]):
        for j in range(gate_idx.shape[1]):
            e = int(gate_idx[t, j])
            if e >= 0 and load[e] < capacity:
                load[e] += 1
            elif e >= 0:
                out[t, j] = -1
    return out


DROP_TABLE = {_key(c[0]) + (c[2],): ch01.drop_reference(*c) for c in ch01.drop_visible()}


def test_drop_over_capacity_honest_passes():
    must_pass(ch01.check_drop_over_capacity, honest_drop)


@pytest.mark.parametrize("cheat", [
    lambda g, e, c: drop_over_capacity(g, e, c),
    lambda g, e, c: limit_by_capacity(g, e, world_size=1, capacity=c)[2],
    via_position_in_expert,
    lambda g, e, c: DROP_TABLE[_key(g) + (c,)],
    token_major,
], ids=["drop_over_capacity", "limit_by_capacity", "position_in_expert", "lookup-table", "token-major-order"])
def test_drop_over_capacity_cheats_fail(cheat):
    must_fail(ch01.check_drop_over_capacity, cheat)


def test_the_visible_drop_case_separates_the_two_orders():
    g, e, c = ch01.drop_visible()[0]
    assert not torch.equal(token_major(g, e, c), ch01.drop_reference(g, e, c))
    assert torch.equal(honest_drop(g, e, c), ch01.drop_reference(g, e, c))
