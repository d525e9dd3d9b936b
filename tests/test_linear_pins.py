"""What mutation testing (make mutate, labutils/moe/linear.py) found unpinned: each test kills surviving mutants,
named in its docstring, with values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from labutils.moe.linear import FMoELinear, MOELinear


def test_no_bias_means_none_and_the_repr_says_so():
    """xǁFMoELinearǁ__init____mutmut_14, extra_repr__mutmut_1."""
    layer = FMoELinear(3, 4, 5, bias=False, rank=1)
    assert layer.bias is None
    assert layer.extra_repr() == "num_expert=3, in_features=4, out_features=5, bias=False, rank=1"
    assert FMoELinear(3, 4, 5).extra_repr() == "num_expert=3, in_features=4, out_features=5, bias=True, rank=0"


def test_input_is_cast_to_the_weights_dtype():
    """xǁFMoELinearǁforward__mutmut_14: a float64 input meets float32 weights as float32, as fastmoe's kernel."""
    torch.manual_seed(0)
    layer = FMoELinear(2, 4, 3)
    x = torch.randn(5, 4)
    y = layer(x.double(), torch.tensor([2, 3]))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, layer(x, torch.tensor([2, 3])), rtol=0, atol=0)


def test_fastmoe_init_bound_is_one_over_root_fan_in_of_the_3d_weight():
    """xǁFMoELinearǁreset_parameters__mutmut_6: kaiming_uniform_(a=sqrt(5)) on (E, out, in): bound 1/sqrt(out*in).
    With a = sqrt(6) the bound would be sqrt(6/7) of that; 16,384 draws reach above 0.95 of the true bound."""
    torch.manual_seed(0)
    w = FMoELinear(4, 64, 64).weight                                         # fan-in torch computes: 64 * 64
    bound = 1 / math.sqrt(64 * 64)
    assert w.abs().max().item() <= bound
    assert w.abs().max().item() > 0.95 * bound


def test_a_buffer_that_does_not_match_the_counts_is_named():
    """xǁMOELinearǁforward__mutmut_6..8: the whole message."""
    w = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"^expert counts sum to 3 but the buffer has 4 rows$"):
        MOELinear.apply(torch.zeros(4, 4), [1, 2], w, None)


def test_zero_experts_forward_and_backward():
    """xǁMOELinearǁbackward__mutmut_28, 30: no experts, no rows: the bias mat-vec's ones vector is empty."""
    w = torch.zeros(0, 3, 4, requires_grad=True)
    b = torch.zeros(0, 3, requires_grad=True)
    x = torch.zeros(0, 4, requires_grad=True)
    MOELinear.apply(x, [], w, b).sum().backward()
    assert w.grad.shape == (0, 3, 4) and b.grad.shape == (0, 3) and x.grad.shape == (0, 4)


def test_frozen_experts_still_pass_gradients_to_the_input():
    """xǁMOELinearǁbackward__mutmut_57: weights that need no gradient get none, and x's gradient is right."""
    torch.manual_seed(0)
    layer = FMoELinear(2, 4, 3).requires_grad_(False)
    x = torch.randn(5, 4, requires_grad=True)
    layer(x, torch.tensor([2, 3])).sum().backward()
    assert layer.weight.grad is None
    want = torch.cat([layer.weight[0].sum(0).expand(2, 4), layer.weight[1].sum(0).expand(3, 4)])
    torch.testing.assert_close(x.grad, want)


def test_the_count_message_names_the_rows_not_the_features():
    """xǁMOELinearǁforward__mutmut_8: x.shape[1] in the message (a square buffer hid it)."""
    with pytest.raises(ValueError, match=r"^expert counts sum to 3 but the buffer has 4 rows$"):
        MOELinear.apply(torch.zeros(4, 6), [1, 2], torch.zeros(2, 3, 6), None)


def test_no_bias_forward_and_backward_against_a_loop():
    """xǁMOELinearǁforward__mutmut_16..22, 40..46 (the bias-free torch.mm path) and backward's grad_x/grad_w without
    a bias: expert 0 takes rows 0-1, expert 1 none, expert 2 rows 2-4; values against a row-by-row loop."""
    torch.manual_seed(0)
    layer = FMoELinear(3, 4, 2, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    counts = [2, 0, 3]
    y = layer(x, counts)
    experts = [0, 0, 2, 2, 2]
    want = torch.stack([layer.weight[e] @ x[i] for i, e in enumerate(experts)])
    torch.testing.assert_close(y, want)
    g = torch.randn(5, 2)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.stack([layer.weight[e].t() @ g[i] for i, e in enumerate(experts)]))
    want_w = torch.zeros(3, 2, 4)
    for i, e in enumerate(experts):
        want_w[e] += torch.outer(g[i], x[i].detach())
    torch.testing.assert_close(layer.weight.grad, want_w)


def test_an_input_without_gradient_still_trains_the_weights():
    """xǁMOELinearǁbackward__mutmut_53: grad_x is None when x needs none (split of None)."""
    layer = FMoELinear(2, 3, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]]]))
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    y = layer(x, [1, 2])
    assert y.tolist() == [[1.0], [5.0], [15.0]]
    y.sum().backward()
    assert layer.weight.grad.tolist() == [[[1.0, 0.0, 0.0]], [[1.0, 2.0, 1.0]]]
    assert layer.bias.grad.tolist() == [[1.0], [2.0]]
