"""FMoETransformerMLP stores experts as fastmoe >= 1.0.1 (one `_Expert` each) and runs them through one fused
Function: same numbers as fastmoe's per-expert loop, old fused checkpoints still load, fastmoe's init."""
import math

import pytest
import torch
from torch import nn

from labutils.compare import compare_tensors
from labutils.moe import FMoETransformerMLP
from labutils.moe.expert_mlp import ExpertMLPs
from labutils.moe.reference import reference_moe


def _grads(layer, x):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("activation", [None, nn.ReLU(), nn.SiLU(), nn.GELU(approximate="tanh")])
def test_fused_path_equals_fastmoes_per_expert_loop(activation):
    torch.manual_seed(0)
    layer = FMoETransformerMLP(num_expert=6, d_model=8, d_hidden=16, top_k=2, activation=activation, init="linear")
    x = torch.randn(5, 8)                                  # 10 choices over 6 experts: some experts get none
    assert layer._fusable()
    torch.manual_seed(1)
    fused = _grads(layer, x)
    layer._fusable = lambda: False                         # FMoE.expert_fn: one _Expert module at a time
    torch.manual_seed(1)
    loop = _grads(layer, x)
    assert compare_tensors("y", fused[0], loop[0], rtol=1e-6, atol=1e-6).close
    assert compare_tensors("dx", fused[1], loop[1], rtol=1e-6, atol=1e-6).close
    assert fused[2].keys() == loop[2].keys() and len(fused[2]) == 4 * 6 + 2
    for name in fused[2]:
        assert compare_tensors(name, fused[2][name], loop[2][name], rtol=1e-5, atol=1e-6).close, name
    torch.manual_seed(1)
    assert compare_tensors("vs brute force", layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6).close


def test_fused_function_gradcheck_with_an_empty_expert():
    torch.manual_seed(0)
    counts = [3, 0, 2]
    params = [torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    params += [torch.randn(1, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    params += [torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    params += [torch.randn(1, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: ExpertMLPs.apply(x, counts, torch.tanh, *p), (x, *params))


def test_parameters_have_fastmoes_names_and_shapes():
    with torch.device("meta"):
        layer = FMoETransformerMLP(num_expert=3, d_model=8, d_hidden=16)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes["experts.2.htoh4.weight"] == (1, 16, 8) and shapes["experts.2.htoh4.bias"] == (1, 16)
    assert shapes["experts.0.h4toh.weight"] == (1, 8, 16) and shapes["experts.0.h4toh.bias"] == (1, 8)
    assert shapes["gate.gate.weight"] == (3, 8)


def test_old_fused_checkpoint_loads_and_gives_the_same_output():
    torch.manual_seed(0)
    layer = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, top_k=2)
    fused = {k: v for k, v in layer.state_dict().items() if not k.startswith("experts.")}
    for name in ("htoh4.weight", "htoh4.bias", "h4toh.weight", "h4toh.bias"):
        fused[f"experts.{name}"] = torch.cat([layer.state_dict()[f"experts.{i}.{name}"] for i in range(4)])
    other = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16, top_k=2)
    other.load_state_dict(fused)
    x = torch.randn(6, 8)
    assert torch.equal(other(x), layer(x))
    fused["experts.htoh4.weight"] = fused["experts.htoh4.weight"][:3]
    with pytest.raises(ValueError, match="3 experts; this layer has num_expert=4"):
        other.load_state_dict(fused)


def test_init_is_fastmoes_unless_asked():
    torch.manual_seed(0)
    fast = FMoETransformerMLP(num_expert=2, d_model=64, d_hidden=256)
    lin = FMoETransformerMLP(num_expert=2, d_model=64, d_hidden=256, init="linear")
    w_fast, w_lin = fast.experts[0].htoh4.weight, lin.experts[0].htoh4.weight
    assert w_fast.abs().max() <= 1 / math.sqrt(256 * 64) + 1e-9             # kaiming(a=sqrt 5): 1/sqrt(out*in)
    assert 0.5 / math.sqrt(64) < w_lin.abs().max() <= 1 / math.sqrt(64) + 1e-9
    assert all(e.htoh4.bias.abs().max() == 0 for e in fast.experts)
    with pytest.raises(ValueError, match="init must be one of"):
        FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=16, init="xavier")


def test_a_subclass_expert_fn_is_used_and_gets_cpu_int64_counts():
    seen = {}

    class Doubling(FMoETransformerMLP):
        def expert_fn(self, inp, fwd_expert_count):
            seen["counts"] = fwd_expert_count
            return 2 * super().expert_fn(inp, fwd_expert_count)

    torch.manual_seed(0)
    layer = Doubling(num_expert=3, d_model=8, d_hidden=16, top_k=2)
    x = torch.randn(5, 8)
    torch.manual_seed(1)
    y = layer(x)
    torch.manual_seed(1)
    assert compare_tensors("2x reference", y, 2 * reference_moe(layer, x), rtol=1e-5, atol=1e-6).close
    c = seen["counts"]
    assert c.dtype == torch.int64 and c.device.type == "cpu" and c.shape == (3,) and int(c.sum()) == 10
