"""labutils.moe as a drop-in for fastmoe on CPU (issue 14), single process.

fastmoe's tests (laekov/fastmoe tests/ at ee3c561) are the specification: the same behaviours are checked here
with our own code against brute-force loops (labutils.moe.reference and small loops below). The distributed
half is tests/test_fastmoe_dist.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labutils.moe import FMoE, FMoETransformerMLP, NaiveGate
from labutils.moe.fastmoe.api import (
    MOEGather,
    MOEScatter,
    _fmoe_general_global_forward,
    count_by_gate,
    limit_by_capacity,
    prepare_forward,
)
from labutils.moe.linear import FMoELinear
from labutils.moe.reference import reference_count_by_gate, reference_limit_by_capacity, reference_moe
from labutils.moe.transformer import _Expert

D = 16


# ---------------------------------------------------------------------------------------- functional API
@pytest.mark.parametrize("ne,topk", [(1, 1), (4, 2), (8, 2)])
def test_count_by_gate_returns_pos_lec_gec(ne, topk):
    torch.manual_seed(ne + topk)
    gate = torch.randint(ne + 1, (12, topk)) - 1                      # -1 = dropped, as fastmoe's test_scatter
    pos, lec, gec = count_by_gate(gate, ne, 1)
    pos_ref, counts_ref = reference_count_by_gate(gate, ne)
    assert torch.equal(pos, pos_ref) and torch.equal(lec, counts_ref) and torch.equal(gec, lec)
    assert lec.dtype == torch.int64
    no_pos, lec2, _ = count_by_gate(gate, ne, 1, require_pos=False)
    assert no_pos is None and torch.equal(lec2, lec)


def test_count_by_gate_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"expected -1 \(dropped\) or 0..3"):
        count_by_gate(torch.tensor([[0, 4]]), 4, 1)
    with pytest.raises(TypeError, match="integer expert ids"):
        count_by_gate(torch.tensor([[0.0, 1.0]]), 4, 1)


@pytest.mark.parametrize("ne,topk", [(1, 1), (4, 2), (8, 2)])
def test_scatter_gather_match_loops_forward_and_backward(ne, topk):
    T = 12
    torch.manual_seed(0)
    gate = torch.randint(ne + 1, (T, topk)) - 1
    pos, lec, gec, fec, fbs = prepare_forward(gate, ne, 1)
    assert fec.device.type == "cpu" and torch.equal(fec, lec) and fbs == int((gate >= 0).sum())
    inp = torch.rand(T, 6, dtype=torch.float64, requires_grad=True)
    rows = torch.div(pos, topk, rounding_mode="floor")
    out = MOEScatter.apply(inp, rows, lec, gec, fbs, 1)
    want = torch.stack([inp[int(p) // topk] for p in pos]) if len(pos) else inp[:0]
    assert torch.equal(out, want)
    back = MOEGather.apply(out * 2, pos, lec, gec, T * topk, 1)
    flat = gate.reshape(-1)
    for i in range(T * topk):                                          # kept choices back in place, zeros else
        expect = 2 * inp[i // topk] if flat[i] >= 0 else torch.zeros(6, dtype=torch.float64)
        assert torch.equal(back[i], expect)
    assert torch.autograd.gradcheck(lambda x: MOEGather.apply(MOEScatter.apply(x, rows, lec, gec, fbs, 1) ** 2,
                                                              pos, lec, gec, T * topk, 1), (inp,))


def test_general_global_forward_zero_gate_and_experts():
    # fastmoe's test_zero_fwd: a 1-D gate (top-1) and an identity expert_fn
    inp = torch.rand(4, 8)
    out = _fmoe_general_global_forward(inp, torch.zeros(4, dtype=torch.int64), lambda x, c: x, 2, 1)
    assert torch.equal(out, inp)
    # per-expert linear maps, (T, k) gate with drops, a dict tree: each output row = W[e] x or zero
    torch.manual_seed(1)
    W = torch.randn(3, 8, 8)
    gate = torch.tensor([[0, 2], [1, -1], [2, 2], [-1, 0]])
    seen = []

    def expert_fn(x, counts):
        seen.append(counts)
        return {k: torch.cat([p @ W[e].T for e, p in enumerate(v.split(counts.tolist()))]) for k, v in x.items()}

    out = _fmoe_general_global_forward({"a": inp, "b": 2 * inp}, gate, expert_fn, 3, 1, experts=None)
    assert seen[0].dtype == torch.int64 and seen[0].device.type == "cpu" and seen[0].tolist() == [2, 1, 3]
    for i, e in enumerate(gate.reshape(-1).tolist()):
        want = W[e] @ inp[i // 2] if e >= 0 else torch.zeros(8)
        torch.testing.assert_close(out["a"][i], want)
        torch.testing.assert_close(out["b"][i], 2 * want)


@pytest.mark.parametrize("cap", [0, 1, 3, 100])
def test_limit_by_capacity_fastmoe_signature(cap):
    """fastmoe's signature and results; the pruned choices in the lab's priority (1st choices, token order)."""
    torch.manual_seed(cap)
    idx = torch.randint(-1, 4, (20, 2))
    new_lec, new_gec, new_idx = limit_by_capacity(idx, 4, 1, cap)
    want_idx = reference_limit_by_capacity(idx, 4, cap)
    load = torch.bincount(want_idx[want_idx >= 0], minlength=4)
    assert torch.equal(new_idx, want_idx) and torch.equal(new_lec, load) and torch.equal(new_gec, new_lec)
    assert torch.equal(limit_by_capacity(idx, 4, 1, torch.full((4,), cap))[2], want_idx)


# ---------------------------------------------------------------------------------------- the layer
class NaiveExpert(nn.Module):       # fastmoe's tests/moe.py experts: take (x, fwd_expert_count)
    def __init__(self, d_model):
        super().__init__()
        self.linear = nn.Linear(d_model, d_model)

    def forward(self, x, fec=None):
        return self.linear(x)


class LinearExpert(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(d_model, d_model * 2), nn.ReLU(), nn.Linear(d_model * 2, d_model))

    def forward(self, x, fec=None):
        return self.model(x)


class FusedMoE(FMoE):               # fastmoe's test_numerical MyMoE: FMoE(expert=None) + a fused _Expert
    def __init__(self, num_expert, d_model, d_hidden, top_k):
        super().__init__(num_expert=num_expert, d_model=d_model, gate=NaiveGate, world_size=1, slice_group=None,
                         top_k=top_k)
        self.experts = _Expert(num_expert, d_model, d_hidden, F.gelu)


@pytest.mark.parametrize("make", ["fused", "naive", "linear", "list"])
@pytest.mark.parametrize("top_k", [2, 3])
def test_layer_matches_brute_force(make, top_k):
    torch.manual_seed(42)
    if make == "fused":
        moe = FusedMoE(4, D, 32, top_k)
        with torch.no_grad():
            for p in moe.experts.parameters():
                p.add_(0.1 * torch.randn_like(p))
    elif make == "list":
        moe = FMoE(num_expert=None, d_model=D, expert=[LinearExpert, NaiveExpert] * 2, top_k=top_k)  # type: ignore[arg-type]
    else:
        moe = FMoE(num_expert=4, d_model=D, expert={"naive": NaiveExpert, "linear": LinearExpert}[make], top_k=top_k)
    x = torch.rand(4, D, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    idx, score = moe.gate(x_ref)
    y, y_ref = moe(x), reference_moe(moe, x_ref, idx, score)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(y.mean(), [x, *moe.experts.parameters()])
    grads_ref = torch.autograd.grad(y_ref.mean(), [x_ref, *moe.experts.parameters()], allow_unused=True)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r, rtol=1e-5, atol=1e-6)


def test_subclass_expert_fn_is_used_with_cpu_int64_counts():
    calls = []

    class Spy(FMoETransformerMLP):
        def expert_fn(self, inp, fwd_expert_count):
            calls.append(fwd_expert_count)
            return 3 * super().expert_fn(inp, fwd_expert_count)

    torch.manual_seed(0)
    spy = Spy(4, D, 32, top_k=2)
    plain = FMoETransformerMLP(4, D, 32, top_k=2)
    plain.load_state_dict(spy.state_dict())
    x = torch.randn(10, D)
    torch.testing.assert_close(spy(x), 3 * plain(x))                   # the override changes the result
    assert len(calls) == 1 and calls[0].dtype == torch.int64 and calls[0].device.type == "cpu"
    assert int(calls[0].sum()) == 10 * 2


# ---------------------------------------------------------------------------------------- nested inputs
class MimoExpert(_Expert):          # fastmoe's test_mimo MyExpert: a dict or list of two tensors
    def forward(self, inp, fwd_expert_count):
        x, y = (inp["x"], inp["y"]) if isinstance(inp, dict) else inp
        x, y = (super(MimoExpert, self).forward(t, fwd_expert_count) for t in (x, y))
        return {"x": x, "y": y} if isinstance(inp, dict) else type(inp)([x, y])


class MimoGate(NaiveGate):
    def forward(self, inp, return_all_scores=False):
        return super().forward(inp["x"] if isinstance(inp, dict) else inp[0], return_all_scores)


class MimoMoE(FMoE):
    def __init__(self, num_expert, d_model, top_k):
        super().__init__(num_expert=num_expert, d_model=d_model, gate=MimoGate, top_k=top_k)
        self.experts = MimoExpert(num_expert, d_model, 4 * d_model, F.gelu)


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nested_inputs_route_together(kind, dtype):
    torch.manual_seed(42)
    moe = MimoMoE(4, D, 2).to(dtype)
    x = torch.rand(4, D, dtype=dtype)
    y_in = torch.rand(4, D, dtype=dtype)
    inp = {"x": x, "y": y_in} if kind == "dict" else {"list": list, "tuple": tuple}[kind]([x, y_in])
    out = moe(inp)
    assert type(out) is type(inp)
    ox, oy = (out["x"], out["y"]) if kind == "dict" else out
    # one gate decision (from x) for both: y's output is what a single-input layer gives y with x's routing
    idx, score = moe.gate(inp)
    single = FMoETransformerMLP(4, D, 4 * D, top_k=2).to(dtype)
    with torch.no_grad():
        for i, e in enumerate(single.experts):
            for name in ("htoh4", "h4toh"):
                getattr(e, name).weight.copy_(getattr(moe.experts, name).weight[i:i + 1])
                getattr(e, name).bias.copy_(getattr(moe.experts, name).bias[i:i + 1])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(ox, reference_moe(single, x, idx, score), **tol)
    torch.testing.assert_close(oy, reference_moe(single, y_in, idx, score), **tol)
    assert torch.equal(moe([x, x.clone()])[0], moe([x, x.clone()])[1])  # fastmoe's check: same input, same out


def test_nested_inputs_with_a_list_of_experts_and_bad_trees():
    torch.manual_seed(0)

    class TwoHead(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)

        def forward(self, inp):
            return {"a": self.lin(inp["a"]), "b": inp["b"] * 2}

    class GateOnA(NaiveGate):
        def forward(self, inp, return_all_scores=False):
            return super().forward(inp["a"], return_all_scores)

    moe = FMoE(3, D, top_k=2, gate=GateOnA, expert=TwoHead)
    a, b = torch.randn(2, 5, D), torch.randn(2, 5, 3)                 # leading dims (2, 5), different widths
    out = moe({"a": a, "b": b})
    assert out["a"].shape == (2, 5, D) and out["b"].shape == (2, 5, 3)
    idx, score = moe.gate({"a": a.reshape(-1, D)})
    torch.testing.assert_close(out["b"].reshape(-1, 3), 2 * b.reshape(-1, 3) * score.sum(1, keepdim=True))
    with pytest.raises(ValueError, match="same leading dims"):
        moe({"a": a, "b": torch.randn(3, 5, 3)})
    with pytest.raises(TypeError, match="tensors or lists/tuples/dicts"):
        moe({"a": a, "b": "text"})


# ---------------------------------------------------------------------------------------- mask / mask_dict
class ConstantGate(nn.Module):      # fastmoe's test_zero gate: everything to expert 0, (T, 1, k) scores of 1/2
    def __init__(self, d_model, num_expert, world_size, top_k=1):
        super().__init__()
        self.top_k = top_k

    def forward(self, inp):
        idx = torch.zeros((inp.shape[0], self.top_k), dtype=torch.int64)
        return idx, torch.ones((inp.shape[0], 1, self.top_k)) / 2


@pytest.mark.parametrize("gate", [ConstantGate, NaiveGate])
def test_mask_rows_skip_experts_and_take_mask_dict_values(gate):
    torch.manual_seed(0)
    T, k = 8, 2
    mask = torch.zeros(T, dtype=torch.long)
    mask[1], mask[4], mask[6] = 1, 2, 3                                # every mask value has an entry
    mask_dict = {1: torch.zeros(D), 2: torch.arange(D, dtype=torch.float32), 3: torch.zeros(D)}
    rows_seen = []

    class Spy(FMoETransformerMLP):
        def expert_fn(self, inp, fwd_expert_count):
            rows_seen.append(inp.shape[0])
            return super().expert_fn(inp, fwd_expert_count)

    masked = Spy(4, D, 4 * D, gate=gate, mask=mask, mask_dict=mask_dict, top_k=k)
    plain = FMoETransformerMLP(4, D, 4 * D, gate=gate, top_k=k)
    plain.load_state_dict(masked.state_dict())
    x = torch.rand(T, D, requires_grad=True)
    y = masked(x)
    assert rows_seen == [(T - 3) * k]                                  # masked rows never reach an expert
    keep = mask == 0
    torch.testing.assert_close(y[keep], plain(x[keep]))
    _, score = masked.gate(x)
    ssum = score.reshape(T, k).sum(1)
    torch.testing.assert_close(y[1], torch.zeros(D))
    torch.testing.assert_close(y[4], mask_dict[2] * ssum[4])
    torch.testing.assert_close(y[6], torch.zeros(D))
    y.sum().backward()
    assert x.grad is not None
    if gate is ConstantGate:                                           # constant scores: masked rows get no grad
        assert torch.all(x.grad[~keep] == 0) and torch.all(x.grad[keep] != 0)


def test_mask_bad_input():
    with pytest.raises(ValueError, match="mask and mask_dict go together"):
        FMoETransformerMLP(4, D, 32, mask=torch.zeros(4))
    layer = FMoETransformerMLP(4, D, 32, mask=torch.zeros(5, dtype=torch.long), mask_dict={1: torch.zeros(D)})
    with pytest.raises(ValueError, match="mask has 5 entries but the input has 4 rows"):
        layer(torch.randn(4, D))


# ---------------------------------------------------------------------------------------- gate contract
@pytest.mark.parametrize("shape", ["flat", "T1k", "Tk"])
def test_gate_output_shapes_and_hook_sees_them_as_returned(shape):
    class ShapedGate(NaiveGate):
        def forward(self, inp, return_all_scores=False):
            idx, score = super().forward(inp)
            if shape == "flat":
                return idx.reshape(-1), score.reshape(-1, 1, self.top_k)   # NoisyGate's shapes
            if shape == "T1k":
                return idx, score.reshape(-1, 1, self.top_k)
            return idx, score

    seen = []
    torch.manual_seed(0)
    layer = FMoETransformerMLP(4, D, 32, top_k=2, gate=ShapedGate,
                               gate_hook=lambda i, s, _: seen.append((tuple(i.shape), tuple(s.shape))))
    ref = FMoETransformerMLP(4, D, 32, top_k=2)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(6, D)
    torch.testing.assert_close(layer(x), ref(x))
    assert seen == [{"flat": ((12,), (6, 1, 2)), "T1k": ((6, 2), (6, 1, 2)), "Tk": ((6, 2), (6, 2))}[shape]]


# ---------------------------------------------------------------------------------------- bad input
def test_bad_input_names_d_model_and_dtypes():
    layer = FMoETransformerMLP(4, D, 32)
    with pytest.raises(ValueError, match=f"d_model={D}"):
        layer(torch.randn(3, D + 1))
    with pytest.raises(ValueError, match=f"d_model={D}"):
        layer(torch.tensor(1.0))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        with pytest.raises(TypeError, match=rf"{dtype}.*torch\.float32"):
            layer(torch.randn(3, D, dtype=dtype))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(3, D, dtype=torch.long))
    with pytest.raises(ValueError, match="slice_group or mp_group"):
        FMoE(4, D, mp_group=object(), slice_group=object())
    with torch.autocast("cpu", dtype=torch.bfloat16):                  # autocast: the experts run in fp32
        y = layer.expert_fn(torch.randn(4, D), torch.tensor([1, 1, 1, 1]))
    assert y.dtype == torch.float32


def test_dropout_activation_backward_uses_the_forward_mask():
    """The fast path recomputes the activation in backward: a Dropout there would draw a new mask."""
    torch.manual_seed(0)
    act = nn.Sequential(nn.ReLU(), nn.Dropout(0.5))
    layer = FMoETransformerMLP(1, D, 64, top_k=1, activation=act)
    assert not layer._fusable()
    x = torch.randn(32, D, requires_grad=True)
    torch.manual_seed(1)
    layer(x).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.experts.parameters()]
    x.grad = None
    layer.zero_grad()
    generic = FMoE.expert_fn                                            # one _Expert at a time, via autograd
    layer.expert_fn = lambda inp, c: generic(layer, inp, c)
    torch.manual_seed(1)
    layer(x).sum().backward()
    want = [x.grad] + [p.grad for p in layer.experts.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    act.eval()
    assert layer._fusable()                                            # dropout off: the fast path again


def test_fmoe_linear_has_fastmoe_layout():
    lin = FMoELinear(3, 5, 7)
    assert lin.weight.shape == (3, 7, 5) and lin.bias is not None and lin.bias.shape == (3, 7)


@pytest.mark.skipif(not torch.cuda.is_available() or not __import__("labutils.optional").optional.available("fmoe"),
                    reason="real fastmoe (fmoe) needs CUDA and its compiled extension; not importable here")
def test_functional_api_and_mask_match_real_fastmoe():
    from labbook.fastmoe_parity import compare_api_with_fastmoe

    report = compare_api_with_fastmoe()
    assert report.ok, report.table()
