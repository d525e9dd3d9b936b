"""labutils.moe (chapter 01): the FastMoE core against brute-force references, fp32 tolerance 1e-5."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from labbook.fastmoe_parity import copy_moe_weights, fused_grads
from labutils.compare import compare_tensors
from labutils.moe import (
    FMoE,
    FMoELinear,
    FMoETransformerMLP,
    GShardGate,
    MOELinear,
    NaiveGate,
    NoisyGate,
    SwitchGate,
    collect_aux_loss,
    count_by_gate,
)
from labutils.moe.reference import (
    reference_count_by_gate,
    reference_moe,
)
from labutils.moe.transformer import _Expert
from labutils.optional import available

TOL = dict(rtol=1e-5, atol=1e-5)
E, D, H = 4, 8, 16
# (gate class, top_k, gate kwargs): small capacities so that tokens really are dropped
GATES = [
    (NaiveGate, 2, {}),
    (NaiveGate, 3, {}),
    (NoisyGate, 2, {}),
    (GShardGate, 2, dict(capacity=(0.6, 0.8))),
    (SwitchGate, 1, dict(capacity=(0.6, 0.8))),
]


def make_layer(gate, top_k, gate_kwargs=None, seed=0, **kw):
    torch.manual_seed(seed)
    gate_cls = gate
    if gate_kwargs:
        def gate_cls(d, e, w, k, gate_bias=True, _g=gate, _kw=gate_kwargs):
            return _g(d, e, w, k, gate_bias=gate_bias, **_kw)
    layer = FMoETransformerMLP(num_expert=kw.pop("num_expert", E), d_model=D, d_hidden=H, top_k=top_k,
                               gate=gate_cls, **kw)
    with torch.no_grad():  # non-zero biases so that bias gradients and dropped rows are visible
        for p in layer.experts.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def run_both(layer, x, seed=1):
    """Fast path and reference on the same input and gate randomness; returns outputs and gradients."""
    grad = torch.randn_like(x)
    results = []
    for fn in (layer, lambda inp: reference_moe(layer, inp)):
        for p in layer.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        torch.manual_seed(seed)
        y = fn(xx)
        y.backward(grad)
        results.append((y.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                               if p.grad is not None}))
    return results


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("gate,top_k,kw", GATES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_layer_matches_per_token_reference(gate, top_k, kw, train):
    layer = make_layer(gate, top_k, kw)
    layer.train(train)
    seen = []
    layer.gate_hook = lambda idx, score, _: seen.append(idx)
    x = torch.randn(3, 10, D)
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = run_both(layer, x)
    if gate in (GShardGate, SwitchGate):
        assert (seen[0] == -1).any(), "capacity small enough that some choices are dropped"
    assert y.shape == x.shape
    assert compare_tensors("output", y, y_ref, **TOL).close
    assert compare_tensors("input grad", gx, gx_ref, **TOL).close
    assert set(gp) == set(gp_ref) and any(n.startswith("gate.") for n in gp)
    for name in gp:
        assert compare_tensors(name, gp[name], gp_ref[name], **TOL).close, name


@pytest.mark.parametrize("gate,top_k,kw", [g for g in GATES if g[0] in (GShardGate, SwitchGate)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_dropped_tokens_contribute_exactly_zero(gate, top_k, kw):
    layer = make_layer(gate, top_k, kw)
    x = torch.randn(40, D)
    torch.manual_seed(3)
    idx, score = layer.gate(x)
    assert (idx == -1).any(), "the test needs drops"
    hook = {}
    layer.gate_hook = lambda i, s, _: hook.update(idx=i.clone())
    torch.manual_seed(3)
    y = layer(x)
    assert torch.equal(hook["idx"], idx)
    dropped_all = (idx == -1).all(dim=1)
    if top_k == 1:
        assert dropped_all.any()
        assert torch.equal(y[dropped_all], torch.zeros_like(y[dropped_all]))
    # the output equals the reference fed the same routing, where -1 adds nothing
    assert compare_tensors("y", y, reference_moe(layer, x, idx, score), **TOL).close


def test_count_by_gate_matches_loop_with_drops():
    torch.manual_seed(0)
    idx = torch.randint(-1, 6, (50, 2))
    pos, counts = count_by_gate(idx, 3, world_size=2)
    pos_ref, counts_ref = reference_count_by_gate(idx, 6)
    assert torch.equal(pos, pos_ref) and torch.equal(counts, counts_ref)
    assert counts.dtype == torch.int64 and counts.shape == (6,)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_gather_and_combine_steps_match_their_definitions_in_float64(top_k, drop):
    """The hand-written autograd of gather (index_select through the inverse permutation, or index_copy with
    drops) and combine (k multiply-adds) against gradcheck, and combine against the plain weighted sum."""
    from labutils.moe.functions import combine, gather
    torch.manual_seed(0)
    T, E, d = 7, 4, 5
    idx = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    if drop:
        idx[::3, 0] = -1
    pos, _ = count_by_gate(idx, E)
    y_sorted = torch.randn(pos.numel(), d, dtype=torch.float64, requires_grad=True)
    score = torch.rand(T, top_k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, s: combine(gather(y, pos, T * top_k), s), (y_sorted, score))
    y_choices = torch.zeros(T * top_k, d, dtype=torch.float64)
    y_choices[pos] = y_sorted.detach()
    want = (score.detach().unsqueeze(-1) * y_choices.view(T, top_k, d)).sum(1)
    assert torch.equal(gather(y_sorted, pos, T * top_k), y_choices)
    assert torch.allclose(combine(y_choices, score), want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="rows of expert output"):
        combine(y_choices[:-1], score)


@pytest.mark.parametrize("top_k,drop", [(1, False), (2, False), (3, True), (2, True)])
def test_fused_gather_combine_equals_the_two_steps(top_k, drop):
    """gather_combine (what FMoE runs) against combine(gather(...)): gradcheck in float64, equal outputs and
    gradients in float32, a float16 score's gradient in float16; bad sizes refused."""
    from labutils.moe.functions import combine, gather, gather_combine
    torch.manual_seed(1)
    T, E, d = 9, 5, 6
    idx = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    if drop:
        idx[::2, -1] = -1
    pos, _ = count_by_gate(idx, E)
    y = torch.randn(pos.numel(), d, dtype=torch.float64, requires_grad=True)
    s = torch.rand(T, top_k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, s: gather_combine(y, pos, s), (y, s))
    y32, s32 = y.detach().float().requires_grad_(), s.detach().float().requires_grad_()
    y32b, s32b = y32.detach().clone().requires_grad_(), s32.detach().clone().requires_grad_()
    g = torch.randn(T, d)
    out_fused, out_steps = gather_combine(y32, pos, s32), combine(gather(y32b, pos, T * top_k), s32b)
    out_fused.backward(g)
    out_steps.backward(g)
    for name, a, b in [("out", out_fused, out_steps), ("grad y", y32.grad, y32b.grad), ("grad s", s32.grad, s32b.grad)]:
        assert compare_tensors(name, a, b, atol=1e-6, rtol=0).close, name
    # negative control: the same comparison catches a wrong position order
    assert not torch.allclose(gather_combine(y32.detach(), pos.flip(0), s32.detach()), out_steps.detach(), atol=1e-3)
    s16 = s32.detach().half().requires_grad_()
    gather_combine(y32.detach(), pos, s16).sum().backward()
    assert s16.grad is not None and s16.grad.dtype == torch.float16
    with pytest.raises(ValueError, match="rows for"):
        gather_combine(y32[:-1], pos, s32)

def test_collect_aux_loss_sums_and_clears():
    model = nn.Sequential(make_layer(GShardGate, 2, dict(capacity=(2.0, 2.0))),
                          make_layer(SwitchGate, 1, dict(capacity=(2.0, 2.0)), seed=1))
    x = torch.randn(16, D)
    model(x)
    want = model[0].gate.loss + model[1].gate.loss
    assert compare_tensors("sum", collect_aux_loss(model), want, **TOL).close
    assert compare_tensors("clear", collect_aux_loss(model, clear=True), want, **TOL).close
    assert float(collect_aux_loss(model)) == 0.0


def test_custom_expert_modules_match_reference():
    torch.manual_seed(0)
    layer = FMoE(num_expert=3, d_model=D, top_k=2,
                 expert=lambda d: nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)))
    x = torch.randn(2, 7, D)
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = run_both(layer, x)
    assert compare_tensors("output", y, y_ref, **TOL).close
    assert compare_tensors("input grad", gx, gx_ref, **TOL).close
    for name in gp:
        assert compare_tensors(name, gp[name], gp_ref[name], **TOL).close, name


def test_fmoe_linear_layout_and_values():
    torch.manual_seed(0)
    lin = FMoELinear(3, 5, 7)
    assert lin.weight.shape == (3, 7, 5) and lin.bias.shape == (3, 7)
    lin.bias.data.normal_()
    counts = [2, 0, 4]
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    lin.double()
    y = lin(x, torch.tensor(counts))
    want = torch.cat([x[:2] @ lin.weight[0].T + lin.bias[0], x[2:] @ lin.weight[2].T + lin.bias[2]])
    assert compare_tensors("y", y, want, **TOL).close
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w, b: MOELinear.apply(a, counts, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda a, w: MOELinear.apply(a, counts, w, None), (x, w))


def test_default_transformer_mlp_has_fastmoe_size():
    with torch.device("meta"):
        layer = FMoETransformerMLP()
    n = sum(p.numel() for p in layer.parameters())
    assert len(layer.experts) == 32 and layer.experts[0].htoh4.weight.shape == (1, 4096, 1024)  # fastmoe >= 1.0.1
    assert 268e6 < n < 269e6


@pytest.mark.parametrize("gate,top_k,kw", GATES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_zero_tokens_and_leading_dims(gate, top_k, kw):
    layer = make_layer(gate, top_k, kw)
    for shape in [(0, D), (2, 0, D)]:
        x = torch.zeros(shape, requires_grad=True)
        y = layer(x)
        assert y.shape == shape
        (y.sum() + collect_aux_loss(layer)).backward()
        assert x.grad.shape == shape and collect_aux_loss(layer).item() == 0.0
    x = torch.randn(2, 3, 5, D)
    assert layer(x).shape == x.shape


def test_run_experts_on_a_contiguous_buffer():
    layer = make_layer(NaiveGate, 2)
    x = torch.randn(9, D)
    counts = torch.tensor([3, 0, 4, 2])
    y = layer.run_experts(x, counts)
    rows = [0, 0, 0, 2, 2, 2, 2, 3, 3]
    from labutils.moe.reference import expert_on_token
    want = torch.stack([expert_on_token(layer, e, x[i]) for i, e in enumerate(rows)])
    assert compare_tensors("y", y, want, **TOL).close
    with pytest.raises(ValueError, match="counts"):
        layer.run_experts(x, torch.tensor([3, 0, 4]))


def test_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="top_k=5"):
        FMoETransformerMLP(num_expert=4, d_model=D, d_hidden=H, top_k=5)
    layer = make_layer(NaiveGate, 2)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(3, D + 1))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(3, D, dtype=torch.long))
    if torch.distributed.is_initialized():  # an earlier in-process DeepSpeed test left a 1-rank group
        with pytest.raises(ValueError, match="world_size=2, but the process group has 1 ranks"):
            FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, world_size=2)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="not initialised"):
        FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=H, world_size=2)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="top-1"):
        FMoE(num_expert=4, d_model=D, top_k=2, gate=SwitchGate, expert=lambda d: nn.Linear(d, d))
    with pytest.raises(ValueError, match="d_model -> d_model"):
        FMoE(num_expert=2, d_model=D, expert=lambda d: nn.Linear(d, d + 1))(torch.randn(5, D))
    with pytest.raises(ValueError, match="d_model -> d_model"):
        FMoE(num_expert=2, d_model=D, expert=lambda d: nn.Linear(d + 1, d))(torch.randn(5, D))


class _BadGate(nn.Module):
    def __init__(self, d, e, w, k, bad="shape"):
        super().__init__()
        self.e, self.bad = e, bad

    def forward(self, x):
        T = x.shape[0]
        if self.bad == "shape":
            return torch.zeros(T, dtype=torch.long), torch.ones(T, 2)
        if self.bad == "range":
            return torch.full((T, 2), self.e), torch.ones(T, 2)
        return torch.zeros(T, 2), torch.ones(T, 2)  # float ids



def test_a_tensor_input_goes_through_no_tree_utility(monkeypatch):
    """FMoE's forward and backward on a plain tensor (masked too) never call tree.py's helpers (issue 25); the
    negative control, a dict input, does."""
    import labutils.moe.layers as layers

    calls = []
    for name in ("tree_flatten", "tree_unflatten", "tree_split", "tree_cat", "exchange_packed"):
        fn = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    torch.manual_seed(0)
    mask = dict(mask=torch.tensor([0, 1, 0, 0]), mask_dict={1: torch.zeros(D)})
    for layer in (make_layer(NaiveGate, 2), FMoETransformerMLP(E, D, H, top_k=2, **mask),
                  FMoE(num_expert=E, d_model=D, top_k=2, expert=lambda d: nn.Linear(d, d))):
        layer(torch.randn(4, D, requires_grad=True)).sum().backward()
    assert calls == []

    class DictGate(NaiveGate):
        def forward(self, inp):
            return super().forward(inp["a"])

    class DictExpert(nn.Linear):
        def forward(self, inp):
            return {"a": super().forward(inp["a"])}

    tree_layer = FMoE(num_expert=E, d_model=D, top_k=2, gate=DictGate, expert=lambda d: DictExpert(d, d))
    tree_layer({"a": torch.randn(4, D)})["a"].sum().backward()
    assert {"tree_flatten", "tree_unflatten", "tree_split", "tree_cat"} <= set(calls)

@pytest.mark.parametrize("bad,match", [("shape", "gate_top_k_idx of shape"), ("range", "expected -1"),
                                       ("dtype", "integer")])
def test_bad_gate_output(bad, match):
    layer = FMoE(num_expert=2, d_model=D, top_k=2, expert=lambda d: nn.Linear(d, d),
                 gate=lambda d, e, w, k: _BadGate(d, e, w, k, bad))
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(4, D))


def test_weight_copy_between_fused_and_per_expert_layouts():
    """Recent fastmoe stores one _Expert(1, ...) per expert; copy_moe_weights maps it to the fused layout."""
    fused = make_layer(NaiveGate, 2)
    torch.manual_seed(1)
    per_expert = FMoE(num_expert=E, d_model=D, top_k=2, expert=lambda d: _Expert(1, d, H, nn.GELU()))
    copy_moe_weights(fused, per_expert)
    x = torch.randn(12, D)
    g = torch.randn(12, D)
    fused(x).backward(g)
    per_expert(x).backward(g)
    assert compare_tensors("y", fused(x), per_expert(x), **TOL).close
    g1, g2 = fused_grads(fused), fused_grads(per_expert)
    assert set(g1) == set(g2)
    for n in g1:
        assert compare_tensors(n, g1[n], g2[n], **TOL).close, n


@pytest.mark.skipif(not available("fmoe") or not torch.cuda.is_available(),
                    reason="real fastmoe (fmoe) needs CUDA and its compiled extension; not importable here")
def test_matches_real_fastmoe():
    from labbook.fastmoe_parity import compare_with_fastmoe
    compare_with_fastmoe().assert_ok()


def test_speed_table_rows_and_statistics_are_consistent():
    """labbook.perf.layer_bench (chapters 01 and 08's speed table) on a tiny shape: every row present, the dense
    row is the reference (paired ratios exactly 1), our layer computes every choice, medians and IQRs come from
    the recorded times, and the paired statistics are ratios of the same rounds. Timings are not asserted."""
    from labbook.perf.layer_bench import REFERENCE, bench_shape
    from labbook.perf.timing import quartiles
    from labbook.perf.verdicts import format_table, paired_speedup

    r = bench_shape(T=64, d=16, h=32, E=4, repeats=4, deepspeed_factors=(), verbose=False)
    rows = {row["row"]: row for row in r["rows"]}
    assert list(rows) == [REFERENCE, "E MLPs, pre-sliced", "argsort + index_add", "grouped_mm, sorted rows",
                          "ours (FMoETransformerMLP)", "ours, again"]
    ref = rows[REFERENCE]
    assert ref["ratio_paired_median"] == 1.0 and ref["ratio_paired_iqr"] == (1.0, 1.0)
    ours = rows["ours (FMoETransformerMLP)"]
    assert ours["share"] == 1.0 and ours["kept_tokens_per_s"] == ours["tokens_per_s"]
    for row in rows.values():
        q1, med, q3 = quartiles(row["times_ms"])
        assert math.isclose(row["median_ms"], med) and math.isclose(row["iqr_pct"], 100 * (q3 - q1) / med)
        assert len(row["times_ms"]) == 4 and row["best_ms"] == min(row["times_ms"])
    want = statistics.median(a / b for a, b in zip(ref["times_ms"], ours["times_ms"]))
    assert math.isclose(ours["ratio_paired_median"], want)
    assert math.isclose(paired_speedup(ours, ref)[0], want)       # same shares: throughput ratio = time ratio
    assert "paired median" in format_table(r) and "faults MB" in format_table(r)
    assert r["order"] == "seeded random order per round"
    assert all(row["faults_mb_per_step"] is not None and row["faults_mb_per_step"] >= 0 for row in rows.values())


def test_rounds_run_in_seeded_random_orders_and_faults_are_counted():
    """Each round is a permutation of the rows, seeded (the same run twice gives the same orders), and not the
    same order every round (negative control: a fixed order would give every row one neighbour throughout).
    The fault counter sees memory first touched inside a step: a fresh 64 MB buffer is >= 8 MB of faults."""
    from labbook.perf.layer_bench import PAGE_BYTES, minor_faults, round_orders

    orders = round_orders(7, 15, seed=0)
    assert all(sorted(o) == list(range(7)) for o in orders) and orders == round_orders(7, 15, seed=0)
    assert len({tuple(o) for o in orders}) > 1
    assert [o.index(0) for o in orders] != [orders[0].index(0)] * 15  # the reference moves too
    before = minor_faults()
    torch.ones(16 * 2 ** 20)                                          # 64 MB, touched once
    assert (minor_faults() - before) * PAGE_BYTES >= 8 * 2 ** 20


def test_quartiles_and_paired_speedup_can_tell_a_slower_row():
    """Negative control: a row twice as slow as the other must read 0.5, not 1."""
    from labbook.perf.timing import quartiles
    from labbook.perf.verdicts import paired_speedup

    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    fast = {"share": 1.0, "times_ms": [10.0, 11.0, 12.0]}
    slow = {"share": 1.0, "times_ms": [20.0, 22.0, 24.0]}
    assert paired_speedup(slow, fast)[0] == 0.5 and paired_speedup(fast, slow)[0] == 2.0
    dropping = {"share": 0.5, "times_ms": [10.0, 11.0, 12.0]}            # same time, half the tokens kept
    assert paired_speedup(fast, dropping)[0] == 2.0


def test_bench_rows_can_be_built_alone_with_the_same_weights():
    """benchmarks/moe_layer.py --memory builds one row per process: the others must not be in its peak RSS."""
    from labbook.perf.layer_bench import build_rows

    every = {r.name: r for r in build_rows(T=16, d=8, h=16, E=4, deepspeed_factors=())}
    (alone,) = build_rows(T=16, d=8, h=16, E=4, deepspeed_factors=(), only="ours (")
    assert alone.name == "ours (FMoETransformerMLP)" and len(every) == 6
    mine = dict(alone.module.named_parameters())
    theirs = dict(every[alone.name].module.named_parameters())
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)  # same seed per row, whichever rows are built
    with pytest.raises(ValueError, match="no row starts with"):
        build_rows(T=16, d=8, h=16, E=4, deepspeed_factors=(), only="nope")


def test_a_ratio_inside_the_repeat_spread_is_a_tie():
    """classify() says "tie" when a ratio is within the run's noise band of the target, "ahead"/"behind"
    outside it; negative controls: with a zero band, 1.01 is ahead and 0.99 behind."""
    from labbook.perf.verdicts import classify, noise_band

    band = noise_band({"paired_median": 0.98, "iqr": (0.95, 1.03)})
    assert band == pytest.approx(0.04)
    assert [classify(r, band) for r in (1.03, 0.97, 1.05, 0.95)] == ["tie", "tie", "ahead", "behind"]
    assert classify(0.93, band, target=0.90) == "tie" and classify(0.95, band, target=0.90) == "ahead"
    assert classify(1.01, 0.0) == "ahead" and classify(0.99, 0.0) == "behind"


def test_pooled_speedup_pairs_rounds_within_each_run():
    """Pooling two runs: ratios are formed inside each round, then one median over all rounds. Negative
    control: pairing across runs would mix a slow run's rows with a fast run's and give another answer."""
    from labbook.perf.verdicts import pooled_speedup

    def run(scale, ours, other):
        return {"rows": [{"row": "ours (x)", "share": 1.0, "times_ms": [scale * t for t in ours]},
                         {"row": "other", "share": 1.0, "times_ms": [scale * t for t in other]}]}

    slow, fast = run(3.0, [10, 10, 10], [11, 11, 11]), run(1.0, [10, 10], [12, 12])
    med, (q1, q3), n = pooled_speedup([slow, fast], "ours (", "other")
    assert n == 5 and med == pytest.approx(1.1) and q1 == pytest.approx(1.1) and q3 == pytest.approx(1.2)
    assert med != pytest.approx(statistics.median([33 / 10, 33 / 10, 12 / 30]))
    with pytest.raises(ValueError, match="at least one run"):
        pooled_speedup([], "ours (", "other")
