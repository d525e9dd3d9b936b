"""Pins for labutils/moe/expert_mlp.py's stated behaviour that the other tests leave open (issue 38's mutation
survivors): which activations take the fused path, the experts' dtype (the weights', whatever the input's), and
autocast switched off around the experts ("in the weights' dtype, as fastmoe's kernels").

The references are written here: a per-expert loop of plain float64 matmuls, never the module's own functions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labutils.moe import FMoETransformerMLP
from labutils.moe.backends import grouped_mm_available
from labutils.moe.expert_mlp import expert_mlps, fusable_activation, grouped_expert_mlps

E, D, H = 3, 8, 16
COUNTS = [3, 0, 5]                                                          # an expert with no rows, on purpose


def _experts(seed: int = 0):
    torch.manual_seed(seed)
    return FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H).experts


def _loop_reference(x: torch.Tensor, experts, act) -> torch.Tensor:
    """Expert e's rows through its two linears, one expert at a time, in float64."""
    out, start = [], 0
    for n, e in zip(COUNTS, experts):
        xe = x[start:start + n].double()
        w1, b1 = e.htoh4.weight[0].double(), e.htoh4.bias[0].double()    # (H, D), (H,)
        w2, b2 = e.h4toh.weight[0].double(), e.h4toh.bias[0].double()    # (D, H), (D,)
        out.append(act(xe @ w1.T + b1) @ w2.T + b2)
        start += n
    return torch.cat(out)


# ---------------------------------------------------------------------------------------- fusable_activation
def test_dropout_is_fusable_exactly_when_it_cannot_draw_a_mask():
    for p, training, fusable in [(0.0, True, True), (0.5, True, False), (1.0, True, False),
                                 (0.5, False, True), (1.0, False, True)]:
        drop = nn.Dropout(p).train(training)
        assert fusable_activation(drop) is fusable, (p, training)


@pytest.mark.parametrize("fn", [F.gelu, F.relu, torch.relu, torch.tanh, torch.sigmoid])
def test_known_elementwise_functions_are_fusable(fn):
    assert fusable_activation(fn) is True


def test_unknown_functions_and_modules_are_not_fusable():
    assert fusable_activation(lambda t: t * 2) is False                    # a function it does not know
    assert fusable_activation(torch.matmul) is False
    assert fusable_activation(nn.Linear(H, H)) is False                    # a module that is not elementwise
    assert fusable_activation(nn.Sequential(nn.GELU(), nn.Dropout(0.5))) is False
    assert fusable_activation(nn.Sequential(nn.GELU(), nn.Dropout(0.5).eval())) is True


# ---------------------------------------------------------------------------------------- dtype and autocast
@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_a_float64_input_runs_in_the_weights_float32(path):
    if path == "grouped" and not grouped_mm_available():
        pytest.skip("torch._grouped_mm missing in this torch")
    experts = _experts()
    x = torch.randn(sum(COUNTS), D, dtype=torch.float64)
    if path == "loop":
        y = expert_mlps(x, COUNTS, experts, nn.GELU())
    else:
        y = grouped_expert_mlps(x, torch.tensor(COUNTS), experts, nn.GELU())
    assert y.dtype == torch.float32
    ref = _loop_reference(x.float(), experts, F.gelu)                      # the input as the weights' dtype
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_autocast_is_off_around_the_experts(path):
    """Under the caller's bfloat16 autocast, the experts still run in float32: the activation sees autocast off,
    and a matmul inside it (a contrived activation that reads the state) would get float32 operands."""
    if path == "grouped" and not grouped_mm_available():
        pytest.skip("torch._grouped_mm missing in this torch")
    experts = _experts()
    seen = []

    def act(t):                                                             # elementwise, but it looks around
        seen.append((torch.is_autocast_enabled("cpu"), t.dtype))
        return F.relu(t)

    x = torch.randn(sum(COUNTS), D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if path == "loop":
            y = expert_mlps(x, COUNTS, experts, act)
        else:
            y = grouped_expert_mlps(x, torch.tensor(COUNTS), experts, act)
    assert seen and all(state == (False, torch.float32) for state in seen), seen
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _loop_reference(x, experts, F.relu), rtol=1e-5, atol=1e-5)
    # negative control: the same activation called under the caller's autocast sees it on
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        act(torch.zeros(1))
    assert seen == [(True, torch.float32)]
