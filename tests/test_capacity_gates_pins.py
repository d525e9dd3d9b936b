"""Pins for ``labutils/moe/capacity_gates.py`` (issue 38: the mutants its other tests left alive).

The constructor's arguments (``topk``, ``gate_bias``, ``group``, the defaults), the exact error and warning
texts, the dtypes of the loss and the score, the boundary of GShard's random routing (``2 * g2 < u`` keeps the
second choice when ``2 * g2 == u``) and Switch's loss when an expert gets no token or nothing is kept, each
against values computed here by hand."""
from __future__ import annotations

import warnings

import pytest
import torch

from labutils.moe import GShardGate, SwitchGate, capacity, capacity_gates
from labutils.moe.capacity_gates import CapacityGate

D = 8


def _set_router(gate, weight, bias=None):
    """Give the gate's linear router fixed weights, so the logits are known."""
    with torch.no_grad():
        gate.gate.weight.copy_(torch.as_tensor(weight, dtype=gate.gate.weight.dtype))
        if bias is not None:
            gate.gate.bias.copy_(torch.as_tensor(bias, dtype=gate.gate.bias.dtype))


# ---- the constructor ---------------------------------------------------------------------------------------------
def test_a_top_k_the_gate_does_not_have_is_refused_naming_the_gate():
    with pytest.raises(ValueError) as err:
        GShardGate(D, 4, top_k=1)
    assert str(err.value) == "GShardGate is a top-2 gate; got top_k=1 (pass top_k=2 to FMoE)"
    with pytest.raises(ValueError) as err:
        SwitchGate(D, 4, top_k=2)
    assert str(err.value) == "SwitchGate is a top-1 gate; got top_k=2 (pass top_k=1 to FMoE)"


def test_fastmoes_topk_spelling_wins_over_top_k():
    assert GShardGate(D, 4, top_k=1, topk=2).top_k == 2     # top_k=1 alone is refused (above)
    assert SwitchGate(D, 4, top_k=2, topk=1).top_k == 1
    with pytest.raises(ValueError, match="top-2 gate; got top_k=3"):
        GShardGate(D, 4, top_k=2, topk=3)


@pytest.mark.parametrize("cls", [GShardGate, SwitchGate])
def test_gate_bias_reaches_the_router(cls):
    assert cls(D, 4).gate.bias is not None                  # default: a bias, as fastmoe's gates
    assert cls(D, 4, gate_bias=True).gate.bias is not None
    assert cls(D, 4, gate_bias=False).gate.bias is None
    assert cls(D, 4, gate_bias=False, topk=cls.fixed_top_k).gate.bias is None


def test_defaults():
    g = GShardGate(D, 4)
    assert (g.world_size, g.tot_expert, g.top_k, g.capacity, g.random_routing) == (1, 4, 2, (1.2, 2.4), True)
    s = SwitchGate(D, 4)
    assert (s.world_size, s.tot_expert, s.top_k, s.capacity, s.switch_eps, s.group) == (1, 4, 1, (1.2, 2.4), 0.1,
                                                                                        None)
    marker = object()
    assert SwitchGate(D, 4, group=marker).group is marker


def test_a_capacity_gate_without_a_formula_says_so():
    class Halfway(CapacityGate):
        fixed_top_k = 1

    gate = Halfway(D, 4, 1, 1, (1.0, 1.0), True)
    with pytest.raises(NotImplementedError) as err:
        gate.capacity_formula(10, 1.0)
    assert str(err.value) == "Halfway must define capacity_formula"


def test_a_capacity_below_one_warns_naming_the_gate_the_factor_and_the_tokens():
    gate = GShardGate(D, 16, random_routing=False)   # floor(ceil(1.2 * 2) * 2 / 16) = floor(6 / 16) = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert gate.capacity_per_expert(2) == 0
    assert [str(w.message) for w in seen] == [
        "GShardGate: capacity factor 1.2 with 2 tokens gives 0 tokens per expert (< 1): every choice is dropped; "
        "raise the factor or the batch"]


@pytest.mark.parametrize("cls", [GShardGate, SwitchGate])
def test_nan_logits_are_refused_naming_the_gate(cls):
    gate = cls(D, 4)
    x = torch.zeros(3, D)
    x[1, 0] = float("nan")
    with pytest.raises(ValueError) as err:
        gate(x)
    assert str(err.value).startswith(f"{cls.__name__}: the gate logits of 1 of 3 tokens are NaN or inf "
                                     "(token indices 1)")


# ---- GShard -------------------------------------------------------------------------------------------------------
def test_gshard_loss_keeps_the_logits_dtype():
    torch.manual_seed(0)
    gate = GShardGate(D, 4, random_routing=False).to(torch.bfloat16)
    gate(torch.randn(6, D, dtype=torch.bfloat16))
    assert gate.get_loss().dtype == torch.bfloat16          # c_e is cast to the logits' dtype, not left in fp32


def test_gshard_loss_of_no_tokens_is_a_zero_tensor_on_the_graph():
    gate = GShardGate(D, 4)
    gate(torch.zeros(0, D))
    loss = gate.get_loss()
    assert isinstance(loss, torch.Tensor) and loss.item() == 0.0 and loss.requires_grad


def test_random_routing_keeps_the_second_choice_when_twice_its_score_equals_the_draw(monkeypatch):
    torch.manual_seed(1)
    gate = GShardGate(D, 4, capacity=(8.0, 8.0))   # room for every choice
    x = torch.randn(5, D)
    idx, score, _ = gate.top_k_logits(x)
    tie = (2 * score[:, 1]).detach()
    monkeypatch.setattr(capacity_gates.torch, "rand", lambda *a, **k: tie.clone())
    got, _ = gate(x)
    assert torch.equal(got, idx)                   # 2 * g2 < u is False at equality: nothing dropped
    monkeypatch.setattr(capacity_gates.torch, "rand", lambda *a, **k: tie + 1e-3)
    got, _ = gate(x)
    assert got[:, 1].tolist() == [-1] * 5 and torch.equal(got[:, 0], idx[:, 0])   # negative control


# ---- Switch -------------------------------------------------------------------------------------------------------
def test_switch_score_is_in_the_inputs_dtype():
    torch.manual_seed(2)
    gate = SwitchGate(D, 4).to(torch.bfloat16).eval()
    idx, score = gate(torch.randn(4, D, dtype=torch.bfloat16))
    assert score.dtype == torch.bfloat16 and idx.dtype == torch.int64


def test_switch_loss_when_the_last_experts_get_no_token():
    gate = SwitchGate(D, 4, capacity=(4.0, 4.0)).eval()           # capacity ceil(4 * 3 / 4) = 3: all kept
    _set_router(gate, torch.zeros(4, D), [3.0, 0.0, 0.0, -1.0])  # every token picks expert 0
    x = torch.randn(3, D)
    idx, _ = gate(x)
    assert idx.flatten().tolist() == [0, 0, 0]
    p = torch.softmax(torch.tensor([3.0, 0.0, 0.0, -1.0]), 0)      # the same for every token
    # E * sum_e f_e * P_e / N with f = (1, 0, 0, 0), P_e = 3 p_e, N = 3 kept tokens
    want = 4 * (1.0 * 3 * p[0] / 3)
    assert torch.allclose(gate.get_loss(), want, rtol=1e-6, atol=0)


def test_switch_loss_is_zero_when_nothing_is_kept(monkeypatch):
    # another worker's tokens can take every slot of this worker's experts; simulated with a capacity of 0
    gate = SwitchGate(D, 4).eval()
    monkeypatch.setattr(gate, "capacity_per_expert", lambda num_tokens: 0)
    idx, _ = gate(torch.randn(3, D))
    assert idx.flatten().tolist() == [-1, -1, -1]
    loss = gate.get_loss()
    assert loss.item() == 0.0 and loss.requires_grad


def test_switch_hands_its_group_to_limit_by_capacity(monkeypatch):
    seen = {}
    real = capacity.limit_by_capacity

    def spy(idx, num_expert, *, world_size, capacity, group):
        seen.update(world_size=world_size, capacity=capacity, group=group)
        return real(idx, num_expert, world_size=world_size, capacity=capacity, group=None)

    # the module's globals, not its attribute (reading that old address warns: labutils._deprecate)
    monkeypatch.setitem(vars(capacity_gates), "limit_by_capacity", spy)
    marker = object()
    SwitchGate(D, 4, group=marker).eval()(torch.randn(5, D))
    assert seen == {"world_size": 1, "capacity": 3, "group": marker}   # eval: ceil(2.4 * 5 / 4) = 3
