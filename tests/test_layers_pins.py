"""FMoE (labutils/moe/layers.py) pinned for mutation testing (issue 38), in one process and without a process group.

Error messages are compared in full, defaults by a behaviour that would differ, and outputs against a
token-by-token loop written here (not labutils' reference). A slice or expert-parallel group is faked by
patching ``torch.distributed`` (its sizes) and ``Slice`` / ``all_gather`` of ``layers`` (the collectives), so the
layer's own wiring is checked without ranks; the real collectives are tested in the threaded and dist files."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import labutils.moe.layers as layers
from labutils.collectives import rank_slice
from labutils.moe import FMoE, NaiveGate
from labutils.moe.device_path import device_path, on_device_path

D = 8
TOL = dict(rtol=1e-5, atol=1e-6)


# -- helpers -------------------------------------------------------------------------------------------------

def routing(T: int, k: int, tot: int):
    """A fixed routing: token t's j-th choice is expert (t + 2j) % tot, its 5th token's last choice dropped, and
    scores that do not sum to 1 (so a missing or doubled weight shows)."""
    idx = torch.tensor([[(t + 2 * j) % tot for j in range(k)] for t in range(T)], dtype=torch.int64)
    if T > 4 and k > 1:
        idx[4, k - 1] = -1
    score = torch.tensor([[0.3 + 0.2 * j + 0.01 * t for j in range(k)] for t in range(T)])
    return idx, score


class FixedGate(nn.Module):
    """Routes by :func:`routing`; records the arguments the layer built it with and each input it saw."""

    def __init__(self, d_model, num_expert, world_size, top_k):
        super().__init__()
        self.args = (d_model, num_expert, world_size, top_k)
        self.tot, self.k, self.seen = num_expert * world_size, top_k, []

    def forward(self, x):
        self.seen.append(x)
        rows = x.shape[0] if torch.is_tensor(x) else next(iter(x.values())).shape[0]
        self.returned = routing(rows, self.k, self.tot)
        return self.returned


def linear_experts(n: int, seed: int = 0, d: int = D):
    """``n`` expert makers, each a seeded nn.Linear(d, d) (one maker per expert, so their weights differ)."""
    def maker(i):
        def make(d_model):
            torch.manual_seed(seed + i)
            return nn.Linear(d_model, d_model)
        return make
    return [maker(i) for i in range(n)]


def loop_reference(experts, x2d, idx, score):
    """y[t] = sum_j score[t, j] * experts[idx[t, j]](x[t]), skipping dropped (-1) choices: one token at a time."""
    out = torch.zeros_like(x2d)
    for t in range(x2d.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= 0:
                out[t] = out[t] + score[t, j] * experts[e](x2d[t:t + 1])[0]
    return out


def layer_of(n=3, k=2, seed=0, **kw):
    return FMoE(num_expert=n, d_model=D, top_k=k, gate=FixedGate, expert=linear_experts(n, seed), **kw)


@pytest.fixture(autouse=True)
def _no_group_left():
    before = dist.is_available() and dist.is_initialized()   # a group an earlier test left is not this test's
    yield
    assert before or not (dist.is_available() and dist.is_initialized()), "this test left a process group initialised"


def fake_group(monkeypatch, size=2, rank=1):
    """A stand-in group object: torch.distributed says it is initialised, ``size`` ranks, this one ``rank``; any
    other group (None: the default one) answers 99, so a call that forgot the group shows."""
    group = object()
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: size if g is group else 99)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: rank if g is group else 98)
    return group


# -- constructor -------------------------------------------------------------------------------------------------

def test_constructor_defaults_are_fastmoes():
    layer = FMoE()
    assert (layer.num_expert, layer.d_model, layer.world_size, layer.top_k) == (32, 1024, 1, 2)
    assert layer.tot_expert == 32 and type(layer.tot_expert) is int
    assert isinstance(layer.gate, NaiveGate) and layer.gate.gate.bias is not None
    assert (layer.gate.d_model, layer.gate.tot_expert, layer.gate.top_k) == (1024, 32, 2)
    assert layer.experts is None and layer.experts_fused is True and layer._expert_takes_count == []
    assert (layer.slice_group, layer.slice_size, layer.slice_rank) == (None, 1, 0)
    assert layer.moe_group is None and layer.gate_hook is None and layer.mask is None and layer.mask_dict is None


def test_gate_bias_goes_only_to_naive_gates():
    assert FMoE(4, D, gate_bias=False).gate.gate.bias is None
    made = []

    def gate_fn(d_model, num_expert, world_size, top_k):                     # no gate_bias parameter
        made.append((d_model, num_expert, world_size, top_k))
        return FixedGate(d_model, num_expert, world_size, top_k)

    FMoE(4, D, top_k=3, gate=gate_fn, gate_bias=False)
    layer = FMoE(5, D, top_k=1, gate=FixedGate)
    assert made == [(D, 4, 1, 3)] and layer.gate.args == (D, 5, 1, 1)


def test_a_list_of_expert_makers_sets_num_expert_and_each_is_called_with_d_model():
    calls = []

    def make(tag):
        def f(d):
            calls.append((tag, d))
            return nn.Linear(d, d)
        return f

    layer = FMoE(num_expert=7, d_model=D, top_k=1, gate=FixedGate, expert=(make("a"), make("b")))
    assert layer.num_expert == 2 and layer.tot_expert == 2 and layer.gate.args == (D, 2, 1, 1)
    assert calls == [("a", D), ("b", D)] and len(layer.experts) == 2 and not layer.experts_fused
    one = FMoE(num_expert=3, d_model=D, top_k=1, gate=FixedGate, expert=make("c"))
    assert calls[2:] == [("c", D)] * 3 and isinstance(one.experts, nn.ModuleList) and len(one.experts) == 3


def test_top_k_is_checked_against_all_experts():
    with pytest.raises(ValueError) as excinfo:
        FMoE(2, D, top_k=3)
    assert str(excinfo.value) == "top_k=3 must be between 1 and the number of experts (world_size * num_expert = 2)"
    with pytest.raises(TypeError) as excinfo:
        FMoE(2, D, top_k=None)
    assert str(excinfo.value) == "top_k must be an int, got None (NoneType)"
    assert FMoE(2, D, top_k=2).top_k == 2


def test_world_size_above_one_needs_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)   # as in a fresh process, whatever ran before
    with pytest.raises(RuntimeError) as excinfo:
        FMoE(2, D, world_size=2)
    assert str(excinfo.value) == ("FMoE(world_size=2) spreads its experts over 2 processes needs a process group, "
                                  "but torch.distributed is not initialised: run it inside labutils.launch(...) "
                                  "workers, or call torch.distributed.init_process_group first")


def test_world_size_is_checked_against_the_moe_group(monkeypatch):
    group = fake_group(monkeypatch, size=3)
    with pytest.raises(ValueError) as excinfo:
        FMoE(2, D, world_size=2, moe_group=group)
    assert str(excinfo.value) == ("FMoE(world_size=2) spreads its experts over 2 processes: world_size=2, but the "
                                  "process group has 3 ranks")
    layer = FMoE(2, D, world_size=3, moe_group=group, top_k=5, gate=FixedGate, expert=linear_experts(2))
    assert layer.moe_group is group and layer.tot_expert == 6 and layer.gate.args == (D, 2, 3, 5)
    assert layer.runs_on_device_path(torch.ones(1, D), None, None) is False


def test_a_moe_group_is_kept_with_one_worker():
    sentinel = object()
    assert FMoE(2, D, moe_group=sentinel).moe_group is sentinel


def test_mask_and_mask_dict_are_kept_and_go_together():
    mask, mask_dict = torch.tensor([0, 1]), {1: torch.zeros(D)}
    layer = layer_of(mask=mask, mask_dict=mask_dict)
    assert layer.mask is mask and layer.mask_dict is mask_dict
    for kw in (dict(mask=mask), dict(mask_dict=mask_dict)):
        with pytest.raises(ValueError) as excinfo:
            layer_of(**kw)
        assert str(excinfo.value) == ("mask and mask_dict go together: mask marks rows (0 = run the experts, key = "
                                      "take mask_dict[key]); fastmoe silently ignores one without the other")


# -- slice_group and its alias mp_group ----------------------------------------------------------------------------

SLICE_MSG = "pass slice_group or mp_group (its deprecated alias), not two different groups"


def test_two_different_slice_groups_are_refused():
    with pytest.raises(ValueError) as excinfo:
        FMoE(4, D, mp_group=object(), slice_group=object())
    assert str(excinfo.value) == SLICE_MSG


@pytest.mark.parametrize("how", ["slice_group", "mp_group", "both"])
def test_slice_group_or_its_alias_sets_size_and_rank(monkeypatch, how):
    group = fake_group(monkeypatch, size=2, rank=1)
    kw = {"slice_group": group, "mp_group": group} if how == "both" else {how: group}
    layer = layer_of(**kw)
    assert layer.slice_group is group and (layer.slice_size, layer.slice_rank) == (2, 1)
    assert layer.runs_on_device_path(torch.ones(1, D), None, None) is False


def test_a_slice_group_needs_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)   # as in a fresh process, whatever ran before
    for kw in (dict(slice_group=object()), dict(mp_group=object())):
        with pytest.raises(RuntimeError) as excinfo:
            FMoE(2, D, **kw)
        assert str(excinfo.value) == ("FMoE(slice_group=...) needs a process group, but torch.distributed is not "
                                      "initialised: run it inside labutils.launch(...) workers, or call "
                                      "torch.distributed.init_process_group first")


class FakeSlice:
    calls: list = []

    @staticmethod
    def apply(x, rank, size, group):
        FakeSlice.calls.append((rank, size, group))
        return rank_slice(x, rank, size)


def test_a_sliced_forward_runs_its_slice_and_gathers_with_the_slice_group(monkeypatch):
    """Rank 1 of a slice group of 2: the layer runs rows 3..5 of 6 (masked ones too), then gathers its outputs
    with the group (the fake gather puts 7s where rank 0's rows would be)."""
    group = fake_group(monkeypatch, size=2, rank=1)
    FakeSlice.calls = []
    gathered = []

    def fake_all_gather(y, dim=0, sizes=None, grad="slice", group=None, *, check=True):
        gathered.append(group)
        return torch.cat([torch.full_like(y, 7.0), y]), None

    monkeypatch.setattr(layers, "Slice", FakeSlice)
    monkeypatch.setattr(layers, "all_gather", fake_all_gather)
    value = torch.arange(D, dtype=torch.float32)
    mask = torch.tensor([0, 0, 2, 0, 2, 0])
    layer = layer_of(slice_group=group, mask=mask, mask_dict={2: value})
    x = torch.randn(2, 3, D)
    y = layer(x)
    assert y.shape == (2, 3, D) and FakeSlice.calls == [(1, 2, group)] and gathered == [group]
    flat = y.reshape(6, D)
    assert torch.equal(flat[:3], torch.full((3, D), 7.0))
    idx, score = routing(3, 2, 3)
    mine = x.reshape(6, D)[3:]
    want = loop_reference(layer.experts, mine, idx, score)
    want[1] = score[1].sum() * value                                   # row 4 is masked (2): mask_dict's value
    torch.testing.assert_close(flat[3:].detach(), want.detach(), **TOL)
    assert torch.equal(layer.gate.seen[0], mine)


def test_a_sliced_forward_without_a_mask(monkeypatch):
    group = fake_group(monkeypatch, size=2, rank=0)
    FakeSlice.calls = []
    monkeypatch.setattr(layers, "Slice", FakeSlice)
    monkeypatch.setattr(layers, "all_gather", lambda y, group=None: (torch.cat([y, torch.zeros_like(y)]), None))
    layer = layer_of(slice_group=group)
    x = torch.randn(4, D)
    y = layer(x)
    assert FakeSlice.calls == [(0, 2, group)]
    idx, score = routing(2, 2, 3)
    torch.testing.assert_close(y[:2], loop_reference(layer.experts, x[:2], idx, score), **TOL)
    assert torch.equal(y[2:], torch.zeros(2, D))


# -- inputs ------------------------------------------------------------------------------------------------------

def test_input_errors_in_full():
    layer = layer_of()
    with pytest.raises(TypeError) as excinfo:
        layer(torch.ones(3, D, dtype=torch.long))
    assert str(excinfo.value) == "FMoE expects a floating-point input, got dtype torch.int64"
    with pytest.raises(ValueError) as excinfo:
        layer(torch.tensor(1.0))
    assert str(excinfo.value) == "FMoE(d_model=8) got a 0-d input; expected (..., d_model)"
    with pytest.raises(ValueError) as excinfo:
        layer(torch.randn(3, D + 1))
    assert str(excinfo.value) == "FMoE(d_model=8) got input of shape (3, 9); the last dimension must be d_model=8"
    with pytest.raises(ValueError) as excinfo:
        layer(torch.randn(2, D, 3))
    assert str(excinfo.value) == "FMoE(d_model=8) got input of shape (2, 8, 3); the last dimension must be d_model=8"
    with pytest.raises(TypeError) as excinfo:
        layer(torch.randn(3, D, dtype=torch.float64))
    assert str(excinfo.value) == ("FMoE input is torch.float64 but the layer's parameters are torch.float32: cast the "
                                  "input (x.to(torch.float32)) or the layer (layer.to(torch.float64))")


def test_flatten_input_checks_and_views():
    layer = layer_of()
    x = torch.randn(2, 3, D)
    assert torch.equal(layer.flatten_input(x), x.reshape(6, D))
    with pytest.raises(TypeError) as excinfo:
        layer.flatten_input([x])
    assert str(excinfo.value) == "FMoE expects a tensor, got list"
    with pytest.raises(TypeError) as excinfo:
        layer.flatten_input(x.double())
    assert str(excinfo.value).startswith("FMoE input is torch.float64 but the layer's parameters are torch.float32")
    with pytest.raises(ValueError) as excinfo:
        layer.flatten_input(torch.randn(4, D + 2))
    assert str(excinfo.value) == "FMoE(d_model=8) got input of shape (4, 10); the last dimension must be d_model=8"


def test_a_layer_without_floating_parameters_takes_any_float_input():
    class NoParamGate(FixedGate):
        pass

    layer = FMoE(2, D, top_k=1, gate=NoParamGate, expert=lambda d: nn.Identity())
    assert layer.param_dtype() is None
    x = torch.randn(3, D, dtype=torch.float64)
    idx, score = routing(3, 1, 2)
    torch.testing.assert_close(layer(x), x * score)
    assert layer_of().param_dtype() == torch.float32 and layer_of().double().param_dtype() == torch.float64


def test_autocast_lets_a_lower_precision_input_through():
    layer = layer_of()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(4, D, dtype=torch.bfloat16))
    assert y.shape == (4, D)


# -- outputs against a token-by-token loop -------------------------------------------------------------------------

@pytest.mark.parametrize("n, k", [(3, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("shape", [(6,), (2, 3), (1, 2, 3)], ids=["T", "BxT", "1xBxT"])
def test_output_equals_the_token_loop(n, k, shape):
    layer = layer_of(n, k, seed=10 * n + k)
    x = torch.randn(*shape, D)
    y = layer(x)
    assert y.shape == x.shape
    T = x.numel() // D
    idx, score = routing(T, k, n)
    want = loop_reference(layer.experts, x.reshape(T, D), idx, score)
    torch.testing.assert_close(y.reshape(T, D), want, **TOL)
    assert torch.equal(layer.gate.seen[-1], x.reshape(T, D))


def test_a_single_token_vector_and_an_empty_batch():
    layer = layer_of(3, 2)
    v = torch.randn(D)
    idx, score = routing(1, 2, 3)
    torch.testing.assert_close(layer(v), loop_reference(layer.experts, v[None], idx, score)[0], **TOL)
    assert layer(torch.zeros(0, D)).shape == (0, D) and layer(torch.zeros(2, 0, D)).shape == (2, 0, D)


def test_the_default_naive_gate_routes_to_the_top_k_logits():
    torch.manual_seed(3)
    layer = FMoE(4, D, top_k=2, expert=linear_experts(4, 7))
    x = torch.randn(5, D)
    logits = layer.gate.gate(x)
    top, idx = logits.topk(2, dim=-1)
    want = loop_reference(layer.experts, x, idx, torch.softmax(top, dim=-1))
    torch.testing.assert_close(layer(x), want, **TOL)


def test_gradients_reach_the_input_and_only_the_used_experts():
    layer = layer_of(5, 1)                                   # top-1 of 5 experts, 3 tokens: experts 3, 4 unused
    x = torch.randn(3, D, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    used = [e.weight.grad is not None and bool(e.weight.grad.abs().sum() > 0) for e in layer.experts]
    assert used == [True, True, True, False, False]


def test_gate_hook_sees_what_the_gate_returned():
    seen = []
    layer = layer_of(3, 2, gate_hook=lambda idx, score, extra: seen.append((idx, score, extra)))
    x = torch.randn(5, D)
    layer(x)
    idx, score = routing(5, 2, 3)
    assert len(seen) == 1 and torch.equal(seen[0][0], idx) and torch.equal(seen[0][1], score) and seen[0][2] is None
    assert seen[0][0] is layer.gate.returned[0] and seen[0][1] is layer.gate.returned[1]   # as returned, not copies


def test_route_uses_the_input_rows_unless_told_the_token_count():
    layer = layer_of(3, 2)
    x = torch.randn(5, D)
    idx, score = layer.route(x)
    assert torch.equal(idx, routing(5, 2, 3)[0]) and torch.equal(score, routing(5, 2, 3)[1])
    idx, score = layer.route(x, 5)
    assert idx.shape == (5, 2)
    with pytest.raises(ValueError) as excinfo:
        layer.route(x, 4)
    assert str(excinfo.value) == ("the gate returned gate_top_k_idx of shape (5, 2); expected (4, 2) (T tokens, top_k "
                                  "choices)")
    bad = FMoE(3, D, top_k=2, gate=lambda *a: FixedGate(D, 2, 1, 2), expert=linear_experts(3))  # a 2-expert gate
    assert bad.tot_expert == 3
    big = FMoE(2, D, top_k=2, gate=lambda *a: FixedGate(D, 3, 1, 2), expert=linear_experts(2))  # ids up to 2
    with pytest.raises(ValueError):
        big.route(torch.randn(5, D))


def test_masked_rows_take_the_mask_dict_value_weighted_by_their_scores():
    value = torch.linspace(-1, 1, D)
    mask = torch.tensor([0, 3, 0, 0, 3, 0])
    layer = layer_of(3, 2, mask=mask, mask_dict={3: value})
    x = torch.randn(6, D)
    idx, score = routing(6, 2, 3)
    want = loop_reference(layer.experts, x, idx, score)
    want[1] = score[1].sum() * value
    want[4] = score[4].sum() * value                                  # its dropped choice still takes the value
    torch.testing.assert_close(layer(x), want, **TOL)


# -- a tree (MIMO) input ---------------------------------------------------------------------------------------

class DictGate(FixedGate):
    def forward(self, x):
        assert isinstance(x, dict)
        return super().forward(x)


class TwoHead(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, inp):
        return {"a": self.lin(inp["a"]), "b": inp["b"] * 2}


def test_a_dict_input_is_routed_together():
    torch.manual_seed(0)
    layer = FMoE(3, D, top_k=2, gate=DictGate, expert=TwoHead)
    a, b = torch.randn(2, 3, D), torch.randn(2, 3, 5)
    out = layer({"a": a, "b": b})
    assert set(out) == {"a", "b"} and out["a"].shape == (2, 3, D) and out["b"].shape == (2, 3, 5)
    idx, score = routing(6, 2, 3)
    want_a = loop_reference([e.lin for e in layer.experts], a.reshape(6, D), idx, score)
    torch.testing.assert_close(out["a"].reshape(6, D), want_a, **TOL)
    weight = torch.where(idx >= 0, score, torch.zeros_like(score)).sum(1, keepdim=True)
    torch.testing.assert_close(out["b"].reshape(6, 5), 2 * b.reshape(6, 5) * weight, **TOL)
    seen = layer.gate.seen[0]
    assert set(seen) == {"a", "b"} and torch.equal(seen["a"], a.reshape(6, D))


def test_leaves_with_different_leading_dims_are_refused_in_full():
    layer = FMoE(3, D, top_k=2, gate=DictGate, expert=TwoHead)
    with pytest.raises(ValueError) as excinfo:
        layer({"a": torch.randn(2, 5, D), "b": torch.randn(3, 5, 3)})
    assert str(excinfo.value) == "FMoE inputs routed together need the same leading dims; got [(2, 5, 8), (3, 5, 3)]"
    with pytest.raises(ValueError) as excinfo:
        layer({"a": torch.randn(2, D), "b": torch.randn(2, 3), "c": torch.randn(4, 3)})
    assert str(excinfo.value) == "FMoE inputs routed together need the same leading dims; got [(2, 8), (2, 3), (4, 3)]"


def test_one_worker_runs_a_tree_without_packing_it(monkeypatch):
    """exchange_packed (one all-to-all for all leaves) is for expert parallelism; one worker runs the tree as is."""
    packed = []
    real = layers.exchange_packed
    monkeypatch.setattr(layers, "exchange_packed", lambda *a: packed.append(1) or real(*a))
    layer = FMoE(3, D, top_k=2, gate=DictGate, expert=TwoHead)
    layer({"a": torch.randn(4, D), "b": torch.randn(4, 2)})
    assert packed == []


class TreeFused(nn.Module):
    """A fused expert for a dict of leaves: returns ``rows`` rows for leaf ``b`` (a bad one when not the input's)."""

    def __init__(self, rows_b=None):
        super().__init__()
        self.rows_b, self.calls = rows_b, []

    def forward(self, inp, counts):
        self.calls.append(counts)
        b = inp["b"] if self.rows_b is None else torch.zeros(self.rows_b, inp["b"].shape[1])
        return {"a": inp["a"], "b": b}


def fused_layer(experts, n=2, k=1, gate=FixedGate):
    layer = FMoE(n, D, top_k=k, gate=gate)
    layer.experts = experts
    return layer


def test_run_experts_on_a_tree_checks_the_rows_of_every_output():
    layer = fused_layer(TreeFused(rows_b=4), n=2)
    tree = {"a": torch.randn(5, D), "b": torch.randn(5, 3)}
    with pytest.raises(ValueError) as excinfo:
        layer.run_experts(tree, torch.tensor([2, 3]))
    assert str(excinfo.value) == "expert_fn must return 5 rows per output (one per input row), got [(4, 3)]"
    good = fused_layer(TreeFused(), n=2)
    out = good.run_experts(tree, [2, 3])
    assert torch.equal(out["a"], tree["a"]) and torch.equal(out["b"], tree["b"])
    assert good.experts.calls[0].tolist() == [2, 3]
    one = fused_layer(TreeFused(), n=1)
    with pytest.raises(ValueError) as excinfo:
        one.run_experts({"a": torch.randn(3, D), "b": torch.randn(3, 2)}, [4])
    assert str(excinfo.value) == "run_experts needs 1 per-expert counts summing to 3 rows, got [4]"


def test_a_one_leaf_tree_runs_like_a_tensor():
    class OneLeaf(nn.Module):
        def forward(self, inp, counts):
            return {"a": inp["a"] * 3}

    class OneLeafGate(FixedGate):
        def forward(self, x):
            return super().forward(x["a"])

    layer = fused_layer(OneLeaf(), n=2, k=1, gate=OneLeafGate)
    x = torch.randn(4, D)
    out = layer.run_experts({"a": x}, [1, 3])
    assert torch.equal(out["a"], 3 * x)
    y = layer({"a": x})
    torch.testing.assert_close(y["a"], 3 * x * routing(4, 1, 2)[1], **TOL)


# -- run_experts, expert_fn and the experts ------------------------------------------------------------------------

def test_run_experts_counts_in_full():
    layer = layer_of(4, 2)
    x = torch.randn(9, D)
    for counts, shown in (([3, 0, 4], "[3, 0, 4]"), ([3, 0, 4, 1], "[3, 0, 4, 1]"),
                          ([3, 0, 4, 2, 0], "[3, 0, 4, 2, 0]"), (torch.tensor([9, 0, 0, 1]), "[9, 0, 0, 1]")):
        with pytest.raises(ValueError) as excinfo:
            layer.run_experts(x, counts)
        assert str(excinfo.value) == f"run_experts needs 4 per-expert counts summing to 9 rows, got {shown}"
    rows = [0, 0, 0, 2, 2, 2, 2, 3, 3]
    want = torch.stack([layer.experts[e](x[i:i + 1])[0] for i, e in enumerate(rows)])
    for counts in ([3, 0, 4, 2], torch.tensor([3, 0, 4, 2]), (3, 0, 4, 2)):
        torch.testing.assert_close(layer.run_experts(x, counts), want, **TOL)


def test_expert_fn_gets_cpu_int64_counts_on_the_host_path_and_raw_counts_on_the_device_path():
    seen = []

    class Spy(FMoE):
        def expert_fn(self, inp, fwd_expert_count):
            seen.append(fwd_expert_count)
            return inp

    layer = Spy(2, D, top_k=1, gate=FixedGate, expert=linear_experts(2))
    x = torch.randn(5, D)
    assert torch.equal(layer.run_experts(x, [2, 3]), x)
    assert seen[0].dtype == torch.int64 and seen[0].tolist() == [2, 3] and torch.is_tensor(seen[0])
    short = torch.tensor([1, 1], dtype=torch.int32)                   # the device path: dropped rows at the end
    with device_path(True):
        layer.run_experts(x, short)
    assert seen[1] is short


def test_the_experts_output_must_be_d_model_wide_in_full():
    class Wide(nn.Module):
        def forward(self, x, counts):
            return torch.zeros(x.shape[0], x.shape[1] + 1)

    class NotATensor(nn.Module):
        def forward(self, x, counts):
            return [x]

    x = torch.randn(5, D)
    with pytest.raises(ValueError) as excinfo:
        fused_layer(Wide()).run_experts(x, [2, 3])
    assert str(excinfo.value) == "experts must map d_model -> d_model (8); got output of shape (5, 9) for input (5, 8)"
    with pytest.raises(ValueError) as excinfo:
        fused_layer(NotATensor()).run_experts(x, [2, 3])
    assert str(excinfo.value) == "experts must map d_model -> d_model (8); got output of shape () for input (5, 8)"


def test_a_fused_layer_without_experts_says_the_subclass_must_set_them():
    layer = FMoE(2, D, top_k=1, gate=FixedGate)
    with pytest.raises(AssertionError) as excinfo:
        layer.expert_fn(torch.randn(3, D), torch.tensor([1, 2]))
    assert str(excinfo.value) == "FMoE(expert=None) needs the subclass to set self.experts"


def test_a_fused_expert_gets_the_whole_buffer_and_the_counts():
    calls = []

    class Fused(nn.Module):
        def forward(self, x, counts):
            calls.append((x, counts))
            return x * 2

    layer = fused_layer(Fused(), n=2)
    x = torch.randn(4, D)
    counts = torch.tensor([1, 3])
    assert torch.equal(layer.expert_fn(x, counts), 2 * x)
    assert calls[0][0] is x and calls[0][1] is counts


def test_an_expert_that_fails_or_changes_the_width_is_named():
    def narrow(d):
        return nn.Linear(d, d + 1)

    def fails(d):
        return nn.Linear(d + 1, d)

    layer = FMoE(num_expert=2, d_model=D, top_k=1, gate=FixedGate, expert=[lambda d: nn.Linear(d, d), narrow])
    with pytest.raises(ValueError) as excinfo:
        layer(torch.randn(5, D))                                      # tokens 1, 3 go to expert 1
    assert str(excinfo.value) == ("experts must map d_model -> d_model (8); expert 1 returned (2, 9) for input (2, 8)")
    layer = FMoE(num_expert=2, d_model=D, top_k=1, gate=FixedGate, expert=[fails, lambda d: nn.Linear(d, d)])
    with pytest.raises(ValueError) as excinfo:
        layer(torch.randn(5, D))                                      # tokens 0, 2, 4 go to expert 0
    cause = excinfo.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert str(excinfo.value) == f"expert 0 failed on a (3, 8) input: experts must map d_model -> d_model ({cause})"


class CountingExpert(nn.Module):
    """fastmoe's expert signature ``forward(x, count)``; records what it got."""

    def __init__(self, d, scale=1.0):
        super().__init__()
        self.lin, self.scale, self.seen = nn.Linear(d, d), scale, []

    def forward(self, x, count=None):
        self.seen.append((x.shape[0], count))
        return self.lin(x) * self.scale


def test_an_expert_taking_a_count_gets_its_row_count():
    torch.manual_seed(0)
    layer = FMoE(num_expert=2, d_model=D, top_k=1, gate=FixedGate,
                 expert=[lambda d: nn.Linear(d, d), lambda d: CountingExpert(d)])
    assert layer._expert_takes_count == [False, True]
    x = torch.randn(5, D)
    y = layer(x)
    (rows, count), = layer.experts[1].seen
    assert rows == 2 and torch.equal(count, torch.tensor([2]))
    idx, score = routing(5, 1, 2)
    torch.testing.assert_close(y, loop_reference(layer.experts, x, idx, score), **TOL)


def test_the_count_check_is_cached_at_construction_and_computed_for_a_new_expert():
    layer = FMoE(num_expert=2, d_model=D, top_k=1, gate=FixedGate, expert=[CountingExpert, CountingExpert])
    layer._expert_takes_count = [False]                               # the cache says "x only" for expert 0
    x = torch.randn(3, D)
    layer.expert_fn_single(x, torch.tensor([3, 0]), 0)
    layer.expert_fn_single(x[:2], torch.tensor([1, 2]), 1)             # past the cache: asks the expert itself
    assert layer.experts[0].seen == [(3, None)]
    (rows, count), = layer.experts[1].seen
    assert rows == 2 and torch.equal(count, torch.tensor([2]))


def test_expert_fn_single_runs_one_expert_on_its_rows():
    layer = layer_of(3, 1)
    x = torch.randn(4, D)
    torch.testing.assert_close(layer.expert_fn_single(x, torch.tensor([0, 0, 4]), 2), layer.experts[2](x))
    with pytest.raises(ValueError) as excinfo:
        FMoE(2, D, top_k=1, gate=FixedGate, expert=[lambda d: nn.Linear(d, 3)] * 2).expert_fn_single(
            x, torch.tensor([4, 0]), 1)
    assert str(excinfo.value) == "experts must map d_model -> d_model (8); expert 1 returned (4, 3) for input (4, 8)"


def test_expert_fn_with_no_expert_rows_returns_an_empty_buffer():
    layer = layer_of(3, 1)
    x = torch.randn(0, D)
    assert layer.expert_fn(x, torch.tensor([0, 0, 0])).shape == (0, D)
    assert layer.expert_fn(x, torch.zeros(0, dtype=torch.int64)).shape == (0, D)


@pytest.mark.parametrize("forward, takes", [
    ("def forward(self, x): return x", False),
    ("def forward(self, x, count): return x", True),
    ("def forward(self, x, count=None): return x", True),
    ("def forward(self, x, /, count): return x", True),
    ("def forward(self, x, *rest): return x", True),
    ("def forward(self, *rest): return rest[0]", True),
    ("def forward(self, x, *, count=None): return x", False),
    ("def forward(self, x, **kw): return x", False),
])
def test_takes_count_reads_the_forward_signature(forward, takes):
    namespace: dict = {}
    exec(f"class M(nn.Module):\n    {forward}\n", {"nn": nn}, namespace)
    assert layers._takes_count(namespace["M"]()) is takes


def test_takes_count_of_a_forward_without_a_signature_is_false():
    m = nn.Module()
    m.forward = max                                                   # a builtin inspect cannot read
    assert layers._takes_count(m) is False
    assert layers._takes_count(nn.Linear(2, 2)) is False


# -- the device path, dp_comm tags -------------------------------------------------------------------------------

class ClaimsGrouped(FMoE):
    """Says its experts are grouped (so the forward may take the device path) when given a float32 input."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.paths = []

    def expert_backend(self, x):
        return "grouped" if x.dtype == torch.float32 else "loop"

    def expert_fn(self, inp, fwd_expert_count):
        self.paths.append(on_device_path())
        return super().expert_fn(inp, fwd_expert_count)


def test_the_device_path_is_taken_only_with_grouped_experts_one_rank_one_tensor_no_mask():
    plain = layer_of()
    x = torch.randn(2, D)
    assert plain.expert_backend(x) == "loop"
    assert plain.runs_on_device_path(x, None, None) is False
    grouped = ClaimsGrouped(2, D, top_k=1, gate=FixedGate, expert=linear_experts(2))
    assert grouped.runs_on_device_path(x, None, None) is True
    assert grouped.runs_on_device_path(x.double(), None, None) is False
    assert grouped.runs_on_device_path(x, object(), None) is False
    assert grouped.runs_on_device_path(x, None, torch.zeros(2)) is False
    assert grouped.runs_on_device_path(x, object(), torch.zeros(2)) is False
    grouped.slice_size = 2
    assert grouped.runs_on_device_path(x, None, None) is False
    grouped.slice_size, grouped.world_size = 1, 2
    assert grouped.runs_on_device_path(x, None, None) is False


def test_the_forward_runs_the_experts_on_the_path_it_chose():
    grouped = ClaimsGrouped(2, D, top_k=1, gate=FixedGate, expert=linear_experts(2))
    x = torch.randn(4, D)
    y = grouped(x)
    grouped(x.double().float())
    assert grouped.paths == [True, True]
    plain = FMoE(2, D, top_k=1, gate=FixedGate, expert=linear_experts(2))
    torch.testing.assert_close(y, plain(x), **TOL)
    masked = ClaimsGrouped(2, D, top_k=1, gate=FixedGate, expert=linear_experts(2), mask=torch.tensor([0, 1, 0, 0]),
                           mask_dict={1: torch.zeros(D)})
    masked(x)
    assert masked.paths == [False] and on_device_path() is False


def test_a_tree_input_never_takes_the_device_path():
    class GroupedTree(ClaimsGrouped):
        pass

    layer = GroupedTree(3, D, top_k=2, gate=DictGate, expert=TwoHead)
    out = layer({"a": torch.randn(4, D), "b": torch.randn(4, 2)})
    assert layer.paths == [False] and out["b"].shape == (4, 2)


def test_mark_parallel_comm_tags_experts_and_gate():
    layer = layer_of(2, 1)
    layer.mark_parallel_comm()
    assert {p.dp_comm for p in layer.experts.parameters()} == {"none"}
    gated = FMoE(2, D, top_k=1, expert=linear_experts(2))
    gated.mark_parallel_comm("dp")
    assert {p.dp_comm for p in gated.experts.parameters()} == {"dp"}
    assert {p.dp_comm for p in gated.gate.parameters()} == {"gate"}
    fused = FMoE(2, D, top_k=1)                                       # no experts yet: only the gate is tagged
    fused.mark_parallel_comm("world")
    assert [p.dp_comm for p in fused.parameters()] == ["gate", "gate"]
    lin = nn.Linear(2, 2)
    layers.mark_module_parallel_comm(lin, "dp")
    assert [p.dp_comm for p in lin.parameters()] == ["dp", "dp"]
