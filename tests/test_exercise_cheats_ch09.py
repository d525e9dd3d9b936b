"""Red team for chapter 09's exercises (labbook/checkers/ch09.py): the honest bias update and expert choice
pass; the library functions, their siblings (``update_expert_bias``, a copy of ``bias_update``'s code object,
``reference_routes``, ``ModernMoE``'s own routing), lookup tables of the visible cases and the chapter's known wrong
answers (no mean-centring, ties to the later token, float64 gates) all fail."""
import types

import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch09
from labutils.moe.modern.aux_free import bias_update, update_expert_bias
from labutils.moe.modern.expert_choice import expert_choice_route
from labutils.moe.modern.layer import ModernMoE
from labutils.moe.modern.reference import reference_routes
from labutils.moe.modern.routers import TopKRouter

# --- exercise 1: the bias update -------------------------------------------------------------------------------


def honest_bias(bias, counts, rate):
    counts = counts.float()
    delta = rate * torch.sign(counts.mean() - counts)
    return bias + delta - delta.mean()


def test_honest_bias_update_passes():
    must_pass(ch09.check_bias_update, honest_bias)


def test_bias_update_library_fails():
    must_fail(ch09.check_bias_update, bias_update, "bias_update itself")
    must_fail(ch09.check_bias_update, lambda b, c, r: bias_update(b, c, r), "bias_update wrapped")


_copied = types.FunctionType(bias_update.__code__, {"torch": torch}, "copied", bias_update.__defaults__)


def test_a_copied_code_object_fails():
    must_fail(ch09.check_bias_update, _copied, "bias_update's code object copied before the check")


def test_update_expert_bias_through_a_router_fails():
    def sibling(bias, counts, rate):
        r = TopKRouter(4, len(bias), 1, bias_rate=rate)
        assert r.expert_bias is not None
        with torch.no_grad():
            r.expert_bias.copy_(bias)
            r.tokens_per_expert.copy_(counts)
        update_expert_bias(r)
        return r.expert_bias.detach().clone()

    must_fail(ch09.check_bias_update, sibling, "update_expert_bias on a router")


_BIAS_TABLE = {str(c[1].tolist()): honest_bias(*c) for c in ch09.BIAS_VISIBLE}


def test_bias_lookup_table_fails():
    must_fail(ch09.check_bias_update, lambda b, c, r: _BIAS_TABLE[str(c.tolist())], "lookup table")


def test_bias_update_without_centring_or_with_the_sign_reversed_fails():
    must_fail(ch09.check_bias_update, lambda b, c, r: b + r * torch.sign(c.float().mean() - c.float()),
              "the paper's uncentred step (not the exercise's torchtitan form)")
    must_fail(ch09.check_bias_update, lambda b, c, r: honest_bias(b, c, -r), "sign reversed")


# --- exercise 2: expert choice ---------------------------------------------------------------------------------


def honest_ec(scores, capacity):
    order = torch.sort(scores.t(), dim=1, descending=True, stable=True).indices[:, :capacity]
    return order, scores.t().gather(1, order)


def test_honest_expert_choice_passes():
    must_pass(ch09.check_expert_choice, honest_ec)


def test_expert_choice_library_fails():
    must_fail(ch09.check_expert_choice, expert_choice_route, "expert_choice_route itself")


def test_reference_routes_fails():
    def sibling(scores, capacity):
        T, E = scores.shape
        layer = ModernMoE(4, 4, E, 1, routing="expert", capacity_factor=capacity * E / T)
        with torch.no_grad():                    # logits = x W^T with x = log(scores), W = I: softmax = scores
            layer.router.gate.weight.copy_(torch.eye(E, 4))
        x = torch.zeros(T, 4)
        x[:, :E] = scores.log()
        routes = reference_routes(layer, x)
        idx = torch.tensor([t for t, _, _ in routes]).reshape(E, -1)
        return idx, scores.t().gather(1, idx)

    must_fail(ch09.check_expert_choice, sibling, "reference_routes")


_EC_TABLE = {str(c[0].tolist()): honest_ec(*c) for c in ch09.EC_VISIBLE}


def test_expert_choice_lookup_table_fails():
    must_fail(ch09.check_expert_choice, lambda s, c: _EC_TABLE[str(s.tolist())], "lookup table")


def test_ties_to_the_later_token_fail():
    def later_wins(scores, capacity):
        T = scores.shape[0]
        flipped = torch.sort(scores.flip(0).t(), dim=1, descending=True, stable=True).indices[:, :capacity]
        order = T - 1 - flipped
        return order, scores.t().gather(1, order)

    must_fail(ch09.check_expert_choice, later_wins, "ties broken towards the later token")


def test_token_choice_instead_of_expert_choice_fails():
    def token_choice(scores, capacity):
        k = min(capacity, scores.shape[1])
        top = scores.topk(k, dim=1).indices                                   # (T, k): each token's experts
        return top.t()[:, :capacity], scores.gather(1, top).t()

    must_fail(ch09.check_expert_choice, token_choice, "the routing turned the wrong way")
