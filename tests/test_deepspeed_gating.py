"""labutils.ds.gating re-derives DeepSpeed's gating: bit-exact against deepspeed.moe.sharded_moe (0.19.8)."""
import pytest
import torch

from labutils.ds.gating import Routing, moe_output, routing_from_deepspeed, top1_routing, top2_routing, topk_routing
from labutils.moe.capacity import deepspeed_capacity as ds_capacity
from labutils.moe.capacity import exact_capacity

FIELDS = ("indices", "locations", "weights", "exp_counts", "l_aux")


@pytest.fixture(scope="module")
def sm():
    from labutils.ds import import_deepspeed

    import_deepspeed()
    from deepspeed.moe import sharded_moe

    return sharded_moe


def assert_same(mine: Routing, theirs: Routing, what: str):
    assert mine.capacity == theirs.capacity, f"{what}: capacity {mine.capacity} != {theirs.capacity}"
    for field in FIELDS:
        a, b = getattr(mine, field), getattr(theirs, field)
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: {field} differs\nmine   {a}\ntheirs {b}"


def logits_cases(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        S = int(torch.randint(8, 70, (), generator=g))
        E = int(torch.randint(3, 9, (), generator=g))
        yield torch.randn(S, E, generator=g) * float(torch.rand((), generator=g) * 3 + 0.1)


@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0])  # many drops, train-like, eval-like
def test_top1_matches_deepspeed(sm, cf, drop):
    dropped = 0
    for logits in logits_cases():
        theirs = routing_from_deepspeed(sm.top1gating(logits.clone(), cf, 4, None, None, drop, False,
                                                      sparse_routes=True))
        mine = top1_routing(logits, cf, 4, drop)
        assert_same(mine, theirs, f"top1 cf={cf} drop={drop} S,E={tuple(logits.shape)}")
        dense = sm.top1gating(logits.clone(), cf, 4, None, None, drop, False)[1]
        assert torch.equal(mine.combine_weights(), dense)
        dropped += int((mine.indices < 0).sum())
    if drop and cf <= 1.0:
        assert dropped > 0, "the cases should exercise capacity drops"
    if not drop:
        assert dropped == 0, "drop_tokens=False must keep every route"


@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("cf", [0.5, 1.0, 2.0])
def test_top2_matches_deepspeed(sm, cf, drop):
    for logits in logits_cases(seed=1):
        theirs = routing_from_deepspeed(sm.top2gating(logits.clone(), cf, 4, drop, None, False,
                                                      sparse_routes=True))
        mine = top2_routing(logits, cf, 4, drop)
        assert_same(mine, theirs, f"top2 cf={cf} drop={drop} S,E={tuple(logits.shape)}")
        dense = sm.top2gating(logits.clone(), cf, 4, drop, None, False)[1]
        assert torch.equal(mine.combine_weights(), dense)


@pytest.mark.parametrize("drop", [True, False])
def test_topk3_matches_deepspeed(sm, drop):
    for logits in logits_cases(seed=2):
        theirs = routing_from_deepspeed(sm.topkgating(logits.clone(), 3, 0.75, 4, drop, sparse_routes=True))
        assert_same(topk_routing(logits, 3, 0.75, 4, drop), theirs, f"top3 drop={drop}")


def test_sampling_reproduced_with_the_same_random_numbers(sm):
    """RTS priorities are torch.rand(S, E); the 2nd-expert noise is Gumbel(0, 1): same seed, same routes."""
    logits = torch.randn(64, 4)
    torch.manual_seed(5)
    theirs = routing_from_deepspeed(sm.top1gating(logits.clone(), 0.5, 0, use_rts=True, sparse_routes=True))
    torch.manual_seed(5)
    assert_same(top1_routing(logits, 0.5, 0, priority=torch.rand(64, 4)), theirs, "top1 with RTS")
    torch.manual_seed(6)
    theirs = routing_from_deepspeed(sm.top2gating(logits.clone(), 0.5, 0, sparse_routes=True))
    torch.manual_seed(6)
    noise = torch.distributions.Gumbel(0.0, 1.0).rsample((64, 4))
    assert_same(top2_routing(logits, 0.5, 0, noise=noise), theirs, "top2 with 2nd-expert sampling")


def test_train_vs_eval_capacity_through_topkgate(sm):
    torch.manual_seed(0)
    x = torch.randn(48, 8)
    for k in (1, 2):
        gate = sm.TopKGate(8, 4, k=k, capacity_factor=0.5, eval_capacity_factor=1.5, min_capacity=2,
                           use_rts=False, top2_2nd_expert_sampling=False)
        logits = gate.wg(x)
        derive = top1_routing if k == 1 else top2_routing
        for training, cf in ((True, 0.5), (False, 1.5)):
            gate.train(training)
            theirs = routing_from_deepspeed(gate(x, None, True))
            assert theirs.capacity == ds_capacity(48, 4, cf, k, 2)
            assert_same(derive(logits, cf, 2), theirs, f"TopKGate k={k} training={training}")


def test_capacity_float32_quirk(sm):
    assert exact_capacity(100, 4, 1.2, 1) == 30
    assert ds_capacity(100, 4, 1.2, 1) == 31
    gates = torch.zeros(100, 4)
    assert int(sm._capacity(gates, torch.tensor(1.2), torch.tensor(0))) == 31
    assert ds_capacity(3, 4, 1.0, 2, min_capacity=4) == 4  # min_capacity floor


@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_capacity_formula_matches_a_real_topkgate(sm, k):
    """THE capacity formula (labutils.moe.capacity.deepspeed_capacity, ds.gating's ds_capacity) and every helper
    that calls it, against the capacity a real TopKGate reports, at the factors where float32 rounding matters
    and odd token counts."""
    from labutils.moe.capacity import deepspeed_capacity
    from labutils.moe.traffic import deepspeed_bytes

    torch.manual_seed(0)
    checked = 0
    for cf in (1.0, 1.2, 1.25, 2.0):
        for tokens in (7, 33, 100, 101):
            gate = sm.TopKGate(8, 4, k=k, capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0,
                               use_rts=False, top2_2nd_expert_sampling=False)
            theirs = routing_from_deepspeed(gate(torch.randn(tokens, 8), None, True)).capacity
            assert ds_capacity(tokens, 4, cf, k) == theirs, (cf, tokens, k)
            assert deepspeed_capacity(tokens, 4, cf, k=k, min_capacity=0) == theirs, (cf, tokens, k)
            assert deepspeed_bytes(tokens, 4, 2, 8, 4, cf, top_k=k, min_capacity=0) == 4 * theirs * 8 * 4 // 2
            checked += 1
    assert checked == 16


def test_capacity_helpers_have_one_source():
    """The negative control of the test above: the old traffic helper used exact arithmetic and gave 30 here.
    There is one function, at one address: the DeepSpeed wing and the traffic helpers call the core's."""
    from labutils.ds import gating
    from labutils.moe import capacity, traffic

    assert vars(traffic)["deepspeed_capacity"] is vars(gating)["ds_capacity"] is ds_capacity
    assert vars(gating)["deepspeed_dropless_capacity"] is capacity.deepspeed_dropless_capacity
    assert "deepspeed_capacity" not in traffic.__all__ and "ds_capacity" not in gating.__all__
    assert exact_capacity(100, 4, 1.2, 1) == 30
    assert ds_capacity(100, 4, 1.2, min_capacity=0) == ds_capacity(100, 4, 1.2, 1) == 31
    # one default: no floor (the bare _capacity formula); the MoE layer's floor of 4 is passed explicitly
    assert ds_capacity(2, 4, 1.0) == 1 and ds_capacity(2, 4, 1.0, min_capacity=4) == 4


def test_top1_batch_smaller_than_min_capacity(sm):
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="min_capacity=4"):
        top1_routing(logits, 1.0, 4)
    with pytest.raises(AssertionError, match="min_capacity"):
        sm.top1gating(logits, 1.0, 4)
    assert top2_routing(logits, 1.0, 4).capacity == 4  # top-2 pads instead


def test_no_rts_keeps_topk_tie_order_not_token_order(sm):
    logits = torch.zeros(20, 2)
    logits[:, 0] = 1.0  # every token wants expert 0
    r = top1_routing(logits, 0.5, 0)  # C = 5
    kept = (r.indices[0] >= 0).nonzero().flatten().tolist()
    assert len(kept) == 5 and r.kept_counts.tolist() == [5, 0] and r.exp_counts.tolist() == [20, 0]
    assert r.locations[0][kept].tolist() == [0, 1, 2, 3, 4]  # slots are filled in token order


def test_moe_output_matches_the_layer(sm):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2, capacity_factor=0.75, min_capacity=0,
                top2_2nd_expert_sampling=False)
    with torch.no_grad():
        for p in layer.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn_like(p))
        x = torch.randn(32, 8)
        r = top2_routing(layer.deepspeed_moe.gate.wg(x), 0.75, 0)
        assert r.drop_rate > 0
        torch.testing.assert_close(layer(x)[0], moe_output(x, r, layer.deepspeed_moe.experts.deepspeed_experts),
                                   atol=1e-6, rtol=1e-5)
