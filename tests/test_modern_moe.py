"""Chapter 09's modern MoE pieces against brute-force references (labutils.moe.modern.reference) and formulas."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from labutils.moe.backends import grouped_matmul, loop_matmul
from labutils.moe.capacity import expert_capacity, position_in_expert, token_choice_capacity
from labutils.moe.modern.aux_free import attach_bias_update, bias_update, update_expert_bias
from labutils.moe.modern.expert_choice import expert_choice_route
from labutils.moe.modern.experts import RoutedExperts
from labutils.moe.modern.layer import ModernMoE
from labutils.moe.modern.losses import balance_loss, z_loss
from labutils.moe.modern.reference import reference_modern_moe
from labutils.moe.modern.routers import TopKRouter
from labutils.moe.modern.shared import SharedExperts

D, H, E = 8, 12, 6

LAYERS = {
    "softmax top-2": dict(),
    "sigmoid, norm, scale, bias": dict(score_func="sigmoid", route_norm=True, route_scale=2.5, bias_rate=0.1),
    "dropping cf=0.5": dict(capacity_factor=0.5),
    "shared + score before": dict(n_shared=2, shared_hidden=4, score_before_experts=True),
    "expert choice cf=1.5": dict(routing="expert", capacity_factor=1.5),
    "grouped mm": dict(impl="grouped", score_func="sigmoid", route_norm=True),
}


def _layer(**kw):
    torch.manual_seed(0)
    layer = ModernMoE(D, H, E, 2, **kw)
    if layer.router.expert_bias is not None:  # a bias that changes the selection
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
def test_modern_moe_matches_brute_force(name):
    layer = _layer(**LAYERS[name])
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(layer(x), reference_modern_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_reference_catches_a_broken_layer():
    """Negative control: weights taken from the biased scores (the mistake the bias rule forbids) differ."""
    layer = _layer(**LAYERS["sigmoid, norm, scale, bias"])
    x = torch.randn(2, 7, D)
    want = reference_modern_moe(layer, x)
    layer.router.route_norm = False
    assert not torch.allclose(layer(x), want, atol=1e-4)


def test_bias_changes_selection_not_weights():
    torch.manual_seed(1)
    r = TopKRouter(D, E, 2, score_func="sigmoid", bias_rate=0.1)
    x = torch.randn(20, D)
    idx0, w0, s = r(x)
    assert r.expert_bias is not None
    r.expert_bias.copy_(torch.tensor([5.0, 0, 0, 0, 0, 0]))        # expert 0 always selected
    idx1, w1, _ = r(x)
    assert (idx1 == 0).any(1).all() and not (idx0 == 0).any(1).all()
    torch.testing.assert_close(w1, s.gather(1, idx1))               # weights are the unbiased scores


def test_router_formulas():
    torch.manual_seed(2)
    x = torch.randn(10, D)
    for func in ("softmax", "sigmoid"):
        for norm in (False, True):
            r = TopKRouter(D, E, 3, score_func=func, route_norm=norm, route_scale=1.7)
            logits = x @ r.gate.weight.t()
            s = torch.sigmoid(logits) if func == "sigmoid" else torch.softmax(logits, -1)
            top = s.topk(3, -1)
            w = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
            idx, got, _ = r(x)
            torch.testing.assert_close(idx.sort(-1).values, top.indices.sort(-1).values)
            torch.testing.assert_close(got.sort(-1).values, (1.7 * w).sort(-1).values)


def test_grouped_mm_matches_loop_with_empty_experts():
    torch.manual_seed(3)
    counts = torch.tensor([3, 0, 5, 0, 2])
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(5, 8, 12, requires_grad=True)
    g = torch.randn(10, 12)
    y = grouped_matmul(x, w, counts)
    (gx, gw) = torch.autograd.grad(y, (x, w), g)
    y2 = loop_matmul(x, w, counts)
    (gx2, gw2) = torch.autograd.grad(y2, (x, w), g)
    for a, b in ((y, y2), (gx, gx2), (gw, gw2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_layer_gradients_match_loop():
    a, b = _layer(impl="loop"), _layer(impl="grouped")
    x = torch.randn(2, 7, D)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_balance_loss_values_and_sequence_level():
    E_, k = 4, 2
    idx = torch.tensor([[0, 1], [2, 3]] * 4)                           # every expert equally chosen
    assert balance_loss(torch.full((8, E_), 0.25), idx).item() == pytest.approx(1.0)
    skew = torch.tensor([[0, 1]] * 8)                                   # only experts 0 and 1
    s = torch.softmax(torch.tensor([[3.0, 3.0, 0.0, 0.0]]).repeat(8, 1), -1)
    assert balance_loss(s, skew).item() > 1.5
    torch.manual_seed(4)
    s = torch.rand(12, E_)
    idx = s.topk(k, -1).indices
    per_seq = torch.stack([balance_loss(s[i:i + 4], idx[i:i + 4]) for i in range(0, 12, 4)]).mean()
    torch.testing.assert_close(balance_loss(s, idx, seq_len=4), per_seq)
    assert not torch.allclose(balance_loss(s, idx, seq_len=4), balance_loss(s, idx))
    with pytest.raises(ValueError, match="seq_len=5"):
        balance_loss(s, idx, seq_len=5)


def test_z_loss_formula_and_it_shrinks_logits():
    torch.manual_seed(5)
    logits = torch.randn(6, E) * 3
    torch.testing.assert_close(z_loss(logits), (logits.exp().sum(-1).log() ** 2).mean())
    r = TopKRouter(D, E, 2, z_coef=1.0)
    with torch.no_grad():
        r.gate.weight.mul_(20)
    x = torch.randn(64, D)
    opt = torch.optim.Adam(r.parameters(), lr=0.1)
    z0, max0 = z_loss(r.gate(x)).item(), r.gate(x).abs().max().item()
    for _ in range(30):
        r(x)
        opt.zero_grad()
        loss = r.get_loss()
        assert loss is not None
        loss.backward()
        opt.step()
    assert z_loss(r.gate(x)).item() < 0.5 * z0 and r.gate(x).abs().max().item() < 0.8 * max0


def test_bias_update_rule_and_balancing_effect():
    new = bias_update(torch.zeros(4), torch.tensor([10.0, 2, 2, 2]), 0.1, center=False)
    torch.testing.assert_close(new, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    centred = bias_update(torch.zeros(4), torch.tensor([10.0, 2, 2, 2]), 0.1)
    assert abs(centred.sum().item()) < 1e-6 and centred[0] < 0 < centred[1]
    # a router that sends everything to expert 0 is balanced by the bias alone (no gradient step)
    torch.manual_seed(6)
    r = TopKRouter(D, 4, 1, score_func="sigmoid", bias_rate=0.02)
    with torch.no_grad():
        r.gate.weight[0] += 2.0
    x = torch.randn(256, D).abs()
    first = torch.bincount(r(x)[0].flatten(), minlength=4)
    for _ in range(200):
        r(x)
        assert update_expert_bias(r) == 1
    last = torch.bincount(r(x)[0].flatten(), minlength=4)
    assert r.tokens_per_expert.sum() > 0 and first.max() > 2 * last.max()


def test_attach_bias_update_runs_before_each_step():
    layer = _layer(score_func="sigmoid", bias_rate=0.05)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    handle = attach_bias_update(opt, layer)
    assert layer.router.expert_bias is not None
    bias0 = layer.router.expert_bias.clone()
    layer(torch.randn(3, 5, D)).sum().backward()
    opt.step()
    handle.remove()
    assert not torch.equal(bias0, layer.router.expert_bias.detach()) and layer.router.tokens_per_expert.sum() == 0


def test_expert_choice_every_expert_takes_capacity_tokens():
    torch.manual_seed(7)
    s = torch.softmax(torch.randn(20, 5), -1)
    C = expert_capacity(20, 5, 2.0)
    tok, g = expert_choice_route(s, C)
    assert C == 8 and tok.shape == (5, 8)
    for e in range(5):
        assert set(tok[e].tolist()) == set(s[:, e].topk(C).indices.tolist())
    torch.testing.assert_close(g, s.t().gather(1, tok))


def test_expert_choice_is_not_causal_token_choice_is():
    """Editing the LAST token changes an EARLIER token's output under expert choice only."""
    for kw, leaks in ((dict(routing="expert", capacity_factor=1.0), True), (dict(), False)):
        layer = _layer(**kw)
        x = torch.randn(1, 16, D)
        x2 = x.clone()
        x2[0, -1] = 10 * torch.randn(D)
        changed = (layer(x)[0, :-1] - layer(x2)[0, :-1]).abs().amax(-1) > 1e-6
        assert bool(changed.any()) == leaks, kw


def test_token_choice_capacity_keeps_first_choices_first():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2]])
    keep = position_in_expert(idx, 3) < 2                     # what ModernMoE keeps with 2 slots per expert
    assert keep.tolist() == [[True, True], [True, True], [False, True]]
    torch.manual_seed(0)
    layer = ModernMoE(D, H, 3, top_k=2, capacity_factor=0.5).eval()  # ceil(0.5 * 6 * 2 / 3) = 2 slots
    x = torch.randn(6, D)
    routed, _, dropped = layer.route(x, None)                           # (6, 2), -1 where dropped
    idx = layer.router(x)[0]                                            # (6, 2)
    keep = position_in_expert(idx, 3) < token_choice_capacity(6, 3, 0.5, 2)
    assert token_choice_capacity(6, 3, 0.5, 2) == 2 and float(dropped) == 1 - keep.float().mean().item() > 0
    assert routed.tolist() == torch.where(keep, idx, -1).tolist() and (routed == -1).any()


def test_shared_experts_are_a_sum_of_experts():
    torch.manual_seed(8)
    sh = SharedExperts(3, D, 4)
    x = torch.randn(5, D)
    want = sum(torch.nn.functional.gelu(x @ w1) @ w2 for w1, w2 in sh.as_experts())
    torch.testing.assert_close(sh(x), want)


def test_fine_grained_equal_active_params():
    coarse = ModernMoE(16, 32, 8, 2)
    fine = ModernMoE(16, 8, 32, 8)
    assert coarse.active_params() - coarse.router.gate.weight.numel() == \
        fine.active_params() - fine.router.gate.weight.numel()


@pytest.mark.parametrize("kw, match", [
    (dict(score_func="relu"), "score_func"), (dict(balance="global"), "balance"),
    (dict(routing="expert"), "capacity_factor"), (dict(capacity_factor=0), "capacity_factor"),
    (dict(bias_rate=-1.0), "bias_rate"), (dict(impl="triton"), "impl"), (dict(top_k=9), "top_k"),
])
def test_bad_arguments_are_named(kw, match):
    kw = dict(kw)  # the parameter's dict is shared by every run of this case: popping from it broke a rerun
    args = dict(d_model=D, d_hidden=H, num_experts=E, top_k=kw.pop("top_k", 2))
    with pytest.raises(ValueError, match=match):
        ModernMoE(**args, **kw)


def test_bad_inputs_are_named():
    layer = _layer(impl="grouped")
    with pytest.raises(ValueError, match="d_model=8"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="multiples of 4"):
        RoutedExperts(2, 6, 8, impl="grouped")(torch.randn(3, 6), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="counts"):
        RoutedExperts(2, 8, 8)(torch.randn(3, 8), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="capacity"):
        expert_choice_route(torch.rand(4, 2), 5)


def test_runner_records_curves_and_load():
    from labbook.train_modern import run_variant, summary_row
    from labutils.data import char_corpus
    corpus = char_corpus("def f(x):\n    return x + 1\n" * 400, val_every=5, chunk=256)
    cfg = SimpleNamespace(d_model=16, n_heads=2, n_layers=1, block=8, batch=4, steps=6, lr=1e-2, eval_every=3)
    res = run_variant(lambda: ModernMoE(16, 16, 4, 2, score_func="sigmoid", bias_rate=0.01, capacity_factor=1.0),
                      corpus, cfg, seeds=(0, 1))
    row = summary_row(res)
    assert res["val_steps"] == [3, 6] and len(res["final"]) == 2 and math.isfinite(row["val"])
    assert res["final"] == [float(v[-1]) for v in res["val"]] and res["final_prefix"] == []   # the last evaluation
    assert len(res["batch_max_over_mean"][0]) == cfg.steps and row["batch_max_over_mean"] >= 1.0
    assert 0 <= row["batch_min_over_mean"] <= 1.0
    assert row["max_over_mean"] >= 1.0 and 0 < row["entropy"] <= 1.0 and 0 <= row["dropped"] < 1


def test_prefix_loss_equals_the_full_forward_for_a_causal_model_and_not_for_expert_choice():
    from labbook.train_modern import prefix_loss
    from labutils.models import CharLM
    from labutils.train import evaluate_loss, lm_cross_entropy

    ids = torch.randint(0, 20, (6, 12), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    for ffn, causal in ((lambda: ModernMoE(16, 16, 4, 2, capacity_factor=None), True),
                        (lambda: ModernMoE(16, 16, 4, 2, routing="expert", capacity_factor=1.0), False),
                        (lambda: ModernMoE(16, 16, 4, 2, capacity_factor=0.5), False)):
        torch.manual_seed(0)
        model = CharLM(20, 16, 2, 1, 11, ffn)
        full, pre = evaluate_loss(model, x, y, lm_cross_entropy), prefix_loss(model, x, y, lm_cross_entropy)
        assert (abs(full - pre) < 1e-5) == causal, (full, pre)
    with pytest.raises(ValueError, match="prefix_loss"):
        prefix_loss(model, x, y[:, :3], lm_cross_entropy)


def test_per_batch_balance_sees_what_a_window_sum_hides():
    from labbook.train_modern import balance_stats, per_batch_balance

    counts = torch.tensor([[30, 10], [10, 30]] * 5)                  # (10 steps, 2 experts): alternating
    busiest, quietest = per_batch_balance(counts)
    assert torch.allclose(busiest, torch.full((10,), 1.5, dtype=torch.float64))
    assert torch.allclose(quietest, torch.full((10,), 0.5, dtype=torch.float64))
    assert balance_stats(counts.sum(0))[0] == 1.0                     # summed over the window: looks balanced


def test_chapter_09_variants_and_the_ranking_of_a_record():
    from labbook import train_modern

    table = train_modern.variants(16, 1e-3)
    assert len(table) == 10 and all(isinstance(make(), torch.nn.Module) for make in table.values())
    record = {"variants": [{"name": n, "final": [v - 0.01, v, v + 0.01]}
                           for n, v in (("a", 1.50), ("b", 1.51), ("c", 1.60))]}
    lines = train_modern.ranking_lines(record)
    assert lines[0].startswith("a") and "best" in lines[0]
    assert "not distinguishable" in lines[1] and "behind the best (Welch" in lines[2]
    assert set(train_modern.PRESETS) == {"tiny", "full"}


def test_an_empty_record_cannot_be_ranked():
    from labbook import train_modern

    with pytest.raises(ValueError, match="no variant"):
        train_modern.ranking_lines({"variants": []})
