"""Pins for ``labutils/moe/transformer.py`` (issue 38: the mutants its other tests left alive).

The constructor's arguments that reach the experts (``d_hidden``, ``expert_rank``, ``expert_dp_comm``), when the
fused and grouped paths apply (no expert, one expert, replaced experts), the grouped backend's refusal in full,
``init="linear"`` zeroing biases, and the fused-layout loader for a checkpoint that fused only some tensors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from labutils.moe import transformer
from labutils.moe.transformer import FMoETransformerMLP, _Expert, _split_fused_experts


def small(**kw):
    torch.manual_seed(0)
    return FMoETransformerMLP(**{"num_expert": 3, "d_model": 4, "d_hidden": 6, "top_k": 2, **kw})


def test_the_constructor_hands_its_arguments_to_the_experts():
    layer = small()
    assert layer.d_hidden == 6
    for e in layer.experts:
        assert (e.htoh4.rank, e.h4toh.rank) == (0, 0)                   # expert_rank defaults to 0
        assert e.htoh4.bias is not None and e.h4toh.bias is not None
    assert {p.dp_comm for p in layer.experts.parameters()} == {"none"}     # fastmoe's default
    assert {p.dp_comm for p in layer.gate.parameters()} == {"gate"}
    layer = small(expert_rank=3, expert_dp_comm="dp")
    assert all((e.htoh4.rank, e.h4toh.rank) == (3, 3) for e in layer.experts)
    assert {p.dp_comm for p in layer.experts.parameters()} == {"dp"}
    e = _Expert(2, 4, 6, nn.GELU())
    assert (e.htoh4.rank, e.h4toh.rank) == (0, 0)
    assert (e.htoh4.weight.shape, e.h4toh.weight.shape) == ((2, 6, 4), (2, 4, 6))


def test_fused_and_grouped_paths_need_at_least_one_untouched_expert():
    one = small(num_expert=1, top_k=1)
    assert one._groupable() and one._fusable()                          # one expert is enough
    none = small()
    none.experts = nn.ModuleList()                                      # no expert at all
    assert not none._groupable() and not none._fusable()
    fused = small()
    fused.experts = _Expert(3, 4, 6, nn.GELU())                         # one fused module, not a list
    assert fused.expert_modules() == [] and not fused._groupable()


def test_grouped_backend_refuses_replaced_experts_and_auto_falls_back_to_the_loop(monkeypatch):
    layer = small(backend="grouped")
    layer.experts[1] = nn.Identity()
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError) as err:
        layer.expert_backend(x)
    assert str(err.value) == ("FMoETransformerMLP(backend='grouped') needs its own one-expert _Expert modules "
                              "with biases (they were replaced or changed); use backend='loop'")
    auto = small()
    auto.experts[1] = nn.Identity()
    # "auto" picks the grouped backend on CUDA; simulated here, where it would pick the loop anyway
    monkeypatch.setitem(vars(transformer), "pick_backend", lambda backend, device: "grouped")
    assert auto.expert_backend(x) == "loop"
    assert small().expert_backend(x) == "grouped"                       # untouched experts: as picked


def test_untouched_experts_take_the_fused_function(monkeypatch):
    calls = []
    real = transformer.expert_mlps

    def spy(*args):
        calls.append(args[1])
        return real(*args)

    monkeypatch.setitem(vars(transformer), "expert_mlps", spy)
    layer = small()
    y = layer(torch.randn(5, 4))
    assert y.shape == (5, 4) and len(calls) == 1 and sum(calls[0]) == 10   # 5 tokens x top-2


def test_init_linear_zeroes_biases_and_bounds_weights_like_nn_linear():
    layer = small()
    with torch.no_grad():
        for e in layer.experts:
            e.htoh4.bias.fill_(1.0)
            e.h4toh.bias.fill_(1.0)
    layer.reset_expert_parameters_like_linear()
    for e in layer.experts:
        assert not e.htoh4.bias.any() and not e.h4toh.bias.any()
        assert e.htoh4.weight.abs().max() <= 1 / 4 ** 0.5 and e.h4toh.weight.abs().max() <= 1 / 6 ** 0.5


def test_split_fused_experts_splits_whatever_tensors_are_fused():
    # a checkpoint whose first tensors are already split and whose last one is fused
    fused = torch.arange(3 * 4.0).reshape(3, 4)
    state = {"m.experts.h4toh.bias": fused.clone(), "m.other": torch.ones(1)}
    _split_fused_experts(state, "m.", 3)
    assert sorted(state) == ["m.experts.0.h4toh.bias", "m.experts.1.h4toh.bias", "m.experts.2.h4toh.bias",
                             "m.other"]
    for i in range(3):
        assert torch.equal(state[f"m.experts.{i}.h4toh.bias"], fused[i:i + 1])
