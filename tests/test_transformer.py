"""Chapter 03-05 model code: block shapes, dense-path parity with a hand-written reference, aux-loss wiring,
parameter breakdowns counted by hand."""
import math

import pytest
import torch
from torch import nn

from labutils.compare import assert_close
from labutils.models import (
    AUX_COEF,
    Block,
    CharLM,
    DenseMLP,
    ExpertLoadRecorder,
    SelfAttention,
    SeqRegressor,
    book_model,
    make_ffn,
)
from labutils.moe import GShardGate, NaiveGate, NoisyGate, collect_aux_loss
from labutils.optional import available
from labutils.params import count_params


def small_regressor(kind="fmoe", gate=None, d=16, heads=2, experts=4, hidden=32, layers=1, **kw):
    ffn = lambda: make_ffn(kind, d, hidden, num_expert=experts, top_k=2, gate=gate)  # noqa: E731
    return SeqRegressor(d, heads, ffn, n_layers=layers, **kw)


@pytest.mark.parametrize("kind", ["dense", "fmoe"])
def test_block_and_models_keep_shapes(kind):
    torch.manual_seed(0)
    block = Block(16, 4, make_ffn(kind, 16, 32, num_expert=4, top_k=2))
    x = torch.randn(3, 5, 16)
    assert block(x).shape == (3, 5, 16)
    assert small_regressor(kind, layers=2)(x).shape == (3, 5, 16)
    lm = CharLM(11, 16, 4, 2, block_size=8, ffn=lambda: make_ffn(kind, 16, 32, num_expert=4, top_k=2))
    idx = torch.randint(11, (3, 8))
    assert lm(idx).shape == (3, 8, 11)
    with pytest.raises(ValueError, match="block_size"):
        lm(torch.randint(11, (1, 9)))


def test_bad_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match="divisible"):
        SelfAttention(10, 3)
    with pytest.raises(ValueError, match="unknown feed-forward kind"):
        make_ffn("sparse", 8, 8)
    with pytest.raises(ValueError, match="attention must be"):
        book_model(attention="gqa")
    with pytest.raises(ValueError, match="own TopKGate"):
        make_ffn("deepspeed", 8, 8, gate=NaiveGate)


@pytest.mark.skipif(not available("fmoe"), reason="the real fastmoe needs CUDA and a fastmoe build")
def test_real_fastmoe_feed_forward_matches_the_lab_layer_in_shape_and_size():
    torch.manual_seed(0)
    real = Block(16, 2, make_ffn("fastmoe", 16, 32, num_expert=4, top_k=2)).cuda()
    lab = Block(16, 2, make_ffn("fmoe", 16, 32, num_expert=4, top_k=2))
    assert real(torch.randn(2, 5, 16, device="cuda")).shape == (2, 5, 16)
    assert count_params(real).by_category == count_params(lab).by_category


# -- dense path parity ------------------------------------------------------------------------------------------

def ref_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_attention(x, qkv_w, qkv_b, out_w, out_b, heads, causal):
    B, T, d = x.shape
    dh = d // heads
    qkv = x @ qkv_w.T + qkv_b
    q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(B, T, heads, dh).permute(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)                     # (B, h, T, T)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(scores, -1) @ v                                    # (B, h, T, dh)
    return y.permute(0, 2, 1, 3).reshape(B, T, d) @ out_w.T + out_b


def ref_block(x, blk, causal):
    """The pre-norm block written out with explicit formulas (exact erf GELU)."""
    a = blk.attn
    h = x + ref_attention(ref_layer_norm(x, blk.ln1.weight, blk.ln1.bias), a.qkv.weight, a.qkv.bias, a.out.weight,
                          a.out.bias, a.n_heads, causal)
    z = ref_layer_norm(h, blk.ln2.weight, blk.ln2.bias) @ blk.ffn.fc1.weight.T + blk.ffn.fc1.bias
    z = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    return h + z @ blk.ffn.fc2.weight.T + blk.ffn.fc2.bias


@pytest.mark.parametrize("causal", [False, True])
def test_dense_block_matches_hand_written_reference(causal):
    torch.manual_seed(0)
    blk = Block(12, 3, DenseMLP(12, 20), causal=causal).double()
    for p in blk.parameters():  # non-trivial norms and biases
        nn.init.normal_(p, 0.0, 0.5)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    assert_close("dense block vs reference", blk(x), ref_block(x, blk, causal), rtol=1e-10, atol=1e-10)


def test_attention_matches_torch_multihead_attention():
    torch.manual_seed(0)
    mine = SelfAttention(16, 4)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(mine.qkv.weight)
        mha.in_proj_bias.copy_(mine.qkv.bias)
        mha.out_proj.weight.copy_(mine.out.weight)
        mha.out_proj.bias.copy_(mine.out.bias)
    x = torch.randn(3, 6, 16)
    want, _ = mha(x, x, x, need_weights=False)
    assert_close("SelfAttention vs nn.MultiheadAttention", mine(x), want, rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in mine.parameters()) == sum(p.numel() for p in mha.parameters())


def test_causal_lm_does_not_look_ahead():
    torch.manual_seed(0)
    lm = CharLM(7, 16, 2, 2, block_size=10, ffn=lambda: make_ffn("fmoe", 16, 16, num_expert=4, top_k=2))
    idx = torch.randint(7, (1, 10))
    changed = idx.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 7
    a, b = lm(idx)[0], lm(changed)[0]
    assert_close("logits before the change", a[:6], b[:6], rtol=0, atol=1e-6)  # equal up to float rounding
    assert (a[6:] - b[6:]).abs().max() > 1e-3, "positions from 6 on should see their changed tokens"


# -- aux loss wiring ------------------------------------------------------------------------------------------

def test_aux_loss_sums_every_gate_and_clears():
    torch.manual_seed(0)
    model = small_regressor(gate=GShardGate, layers=2)
    model(torch.randn(2, 8, 16))
    gates = [m for m in model.modules() if isinstance(m, GShardGate)]
    assert len(gates) == 2
    want = gates[0].loss + gates[1].loss
    assert want.item() > 0
    assert_close("aux loss", collect_aux_loss(model, clear=True), want)
    assert collect_aux_loss(model, clear=True).item() == 0.0, "a second read without a forward must be 0 (cleared)"


def test_aux_loss_reaches_gradients_with_its_coefficient():
    """One train() step with SGD(lr=1) moves the parameters by exactly -grad(task + AUX_COEF * aux)."""
    from labutils.data import RandomPairs
    from labutils.train import mse, train

    torch.manual_seed(0)
    model = small_regressor(gate=NoisyGate)
    manual = small_regressor(gate=NoisyGate)
    manual.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(1)
    train(model, RandomPairs(2, 8, 16, seed=3), steps=1, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
          progress=False)
    torch.manual_seed(1)
    x, y = RandomPairs(2, 8, 16, seed=3).next_batch()
    out = manual(x)
    gate_losses = [m.loss for m in manual.modules() if isinstance(m, NoisyGate)]
    assert gate_losses[0].item() > 0, "NoisyGate should report a positive balancing loss"
    (mse(out, y) + AUX_COEF * sum(gate_losses)).backward()
    for name, p in manual.named_parameters():
        assert_close(name, model.state_dict()[name], before[name] - p.grad, rtol=1e-5, atol=1e-6)
    w_gate = dict(manual.named_parameters())["blocks.0.ffn.gate.w_noise"]
    assert w_gate.grad.abs().sum() > 0, "the noise weights learn only through the aux loss; it did not reach them"


def test_expert_load_recorder_counts_every_routed_token():
    torch.manual_seed(0)
    model = small_regressor(gate=NaiveGate, layers=3)
    rec = ExpertLoadRecorder(model)
    model(torch.randn(2, 5, 16))
    load = rec.pop()
    assert load.shape == (3, 4)
    assert load.sum(1).tolist() == [2 * 5 * 2] * 3  # tokens x top_k per layer
    assert rec.pop() is None
    rec.close()
    model(torch.randn(2, 5, 16))
    assert rec.pop() is None, "a closed recorder must not count"


# -- parameter counts -----------------------------------------------------------------------------------------

def test_param_breakdown_of_small_config_by_hand():
    d, h, E = 8, 16, 4
    model = small_regressor(d=d, heads=2, experts=E, hidden=h)
    counts = count_params(model).by_category
    attention = 3 * d * d + 3 * d + d * d + d             # qkv weight+bias, out weight+bias = 288
    experts = E * (d * h + h + h * d + d)                 # 4 x 280 = 1120
    gate = d * E + E                                      # 36
    norms = 2 * 2 * d                                     # two LayerNorms = 32
    assert counts == {"attention": attention, "moe experts": experts, "router/gate": gate, "norms": norms}
    no_bias = count_params(small_regressor(d=d, heads=2, experts=E, hidden=h, attn_bias=False, attn_extra_proj=True))
    assert no_bias["attention"] == 5 * d * d


def test_char_lm_breakdown_by_hand():
    V, d, T = 10, 8, 6
    lm = CharLM(V, d, 2, 1, block_size=T, ffn=lambda: DenseMLP(d, 4 * d))
    counts = count_params(lm)
    assert counts["embeddings"] == V * d + T * d
    assert counts["norms"] == 3 * 2 * d
    assert counts["other"] == (2 * d * 4 * d + 4 * d + d) + (d * V + V)  # dense FFN + head


def test_book_model_counts_on_meta_device():
    book = count_params(book_model(attention="5d2"))
    assert book["attention"] == 5 * 1024 ** 2 == 5_242_880
    assert book["moe experts"] + book["router/gate"] == 32 * (2 * 1024 * 4096 + 4096 + 1024) + 1024 * 32 + 32
    assert book["norms"] == 4096
    assert round(book.total / 1e6) == 274 and int(book.total / 1e6) == 273
    mha = count_params(book_model(attention="mha"))
    assert mha["attention"] == 4 * 1024 ** 2 + 4 * 1024 == 4_198_400
    assert round(mha.total / 1e6) == 273
    assert next(book_model().parameters()).device.type == "meta"


# -- DeepSpeed feed-forward -----------------------------------------------------------------------------------

def test_deepspeed_ffn_in_a_block_records_aux_and_counts():
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional")
    import torch.distributed as dist

    from labutils.ds import init_deepspeed, quiet

    had_group = dist.is_initialized()
    init_deepspeed()
    try:
        _deepspeed_ffn_checks(quiet)
    finally:
        if not had_group:  # leave the pytest process as found: later tests expect no process group
            import deepspeed.comm.comm as ds_comm

            dist.destroy_process_group()
            ds_comm.cdb = None
            assert not dist.is_initialized()


def _deepspeed_ffn_checks(quiet):
    torch.manual_seed(0)
    with quiet():
        model = SeqRegressor(16, 2, lambda: make_ffn("deepspeed", 16, 32, num_expert=4, top_k=2), n_layers=2)
    rec = ExpertLoadRecorder(model)
    x = torch.randn(4, 8, 16)
    out = model(x)
    assert out.shape == x.shape
    aux = collect_aux_loss(model, clear=True)
    layers = [b.ffn for b in model.blocks]
    assert aux.item() > 0 and aux.requires_grad
    load = rec.pop()
    assert load.shape == (2, 4) and load.sum(1).tolist() == [4 * 8 * 2] * 2  # both choices, before capacity
    assert all(layer.l_aux is None for layer in layers), "collect_aux_loss(clear=True) must clear what it read"


def test_aux_loss_is_a_deprecated_alias_of_collect_aux_loss():
    from labutils.models import aux_loss

    model = small_regressor("fmoe", GShardGate)
    model(torch.randn(2, 3, 16))
    with pytest.warns(DeprecationWarning, match="collect_aux_loss|_read_and_clear_aux_loss"):
        first = aux_loss(model)
    assert first.item() > 0 and collect_aux_loss(model).item() == 0.0
