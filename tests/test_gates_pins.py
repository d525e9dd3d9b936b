"""labutils/moe/gates.py pinned for mutation testing (issue 38): each test names the mutants it kills.

Error messages are compared in full, defaults by the attribute or behaviour that would differ, and the gates'
outputs and losses against formulas written here (softmax, top-k, Normal's cdf from torch.distributions), never
against the gate's own helpers."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

from labutils.moe.device_path import device_path
from labutils.moe.gates import (
    BaseGate,
    NaiveGate,
    NoisyGate,
    _std_normal_cdf,
    check_finite_logits,
    check_gate_input,
    collect_aux_loss,
    cv_squared,
    router_logits,
)


def full(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "^" + re.escape(text) + "$"


# -- check_gate_input ----------------------------------------------------------------------------------------

def test_a_non_tensor_input_names_the_gate_and_the_type():
    """x_check_gate_input__mutmut_1, 2, 5, 6 (name None, type(None), no message, type(None) of x)."""
    gate = NaiveGate(4, 3)
    with pytest.raises(TypeError, match=full("NaiveGate expects a tensor of shape (tokens, d_model=4), got list")):
        check_gate_input(gate, [[1.0] * 4], 4)


@pytest.mark.parametrize("gate_cls", [NaiveGate, NoisyGate])
def test_a_wrong_shape_and_a_wrong_dtype_are_refused_in_full(gate_cls):
    """x_check_gate_input__mutmut_12, 13, 17; NaiveGate top_k_logits__mutmut_1 and NoisyGate noisy_logits__mutmut_1
    (the gate passed as None: the message names no gate); NoisyGate's __init__ keeps d_model."""
    gate, name = gate_cls(4, 3), gate_cls.__name__
    with pytest.raises(ValueError, match=full(f"{name}(d_model=4) got input of shape (2, 5); expected "
                                              "(tokens, d_model=4)")):
        gate(torch.zeros(2, 5))
    with pytest.raises(TypeError, match=full(f"{name} holds torch.float32 weights but got a torch.float64 input: "
                                             "convert one of them (e.g. gate.to(torch.float32) or "
                                             "x.to(torch.float32))")):
        gate(torch.zeros(2, 4, dtype=torch.float64))


def test_a_one_dimensional_input_is_refused_and_no_dtype_means_any_float():
    gate = NaiveGate(4, 3)
    with pytest.raises(ValueError, match=full("NaiveGate(d_model=4) got input of shape (4,); expected "
                                              "(tokens, d_model=4)")):
        gate(torch.zeros(4))
    check_gate_input(gate, torch.zeros(2, 4, dtype=torch.float64), 4)          # no dtype given: any float


# -- router_logits ---------------------------------------------------------------------------------------------

def test_router_logits_refuses_non_tensors_in_full():
    """x_router_logits__mutmut_5..7."""
    with pytest.raises(TypeError, match=full("router_logits(x, w) takes two tensors, got list and Tensor")):
        router_logits([1.0], torch.zeros(1, 2))
    with pytest.raises(TypeError, match=full("router_logits(x, w) takes two tensors, got Tensor and float")):
        router_logits(torch.zeros(1, 2), 1.0)


def test_router_logits_refuses_bad_shapes_in_full():
    """x_router_logits__mutmut_9 (a 0-d x reaches x.shape[-1]), 18..23 (the message, each part)."""
    for x, w in ((torch.zeros(3, 5), torch.zeros(4, 2)), (torch.tensor(1.0), torch.zeros(1, 2)),
                 (torch.zeros(3, 4), torch.zeros(4))):
        with pytest.raises(ValueError, match=full(
                f"router_logits: w must be (d_model, E) with d_model = x.shape[-1]; got x of shape {tuple(x.shape)} "
                f"and w of shape {tuple(w.shape)} (an (E, d_model) weight, as nn.Linear stores it, is "
                "F.linear(x, w) instead)")):
            router_logits(x, w)


def test_router_logits_takes_one_token_and_batched_tokens():
    """x_router_logits__mutmut_12, 13 (a 1-D x refused), 14 (x.shape[+1]: a 3-D x compared by its dim 1)."""
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])                   # (d=3, E=2)
    x = torch.tensor([1.0, 0.0, -1.0])
    assert router_logits(x, w).tolist() == [-4.0, -4.0]                      # 1*1 + 0*3 - 5, 1*2 + 0*4 - 6
    x3 = torch.tensor([[[1.0, 1.0, 1.0]] * 2] * 4)                          # (4, 2, 3): dim 1 is 2, not 3
    assert router_logits(x3, w).tolist() == [[[9.0, 12.0]] * 2] * 4


# -- check_finite_logits ---------------------------------------------------------------------------------------

def nan_rows(T: int, bad: list) -> torch.Tensor:
    logits = torch.zeros(T, 3)
    for t in bad:
        logits[t, t % 3] = math.inf if t % 2 else math.nan
    return logits


@pytest.mark.parametrize("bad, shown", [
    ([1], "1"),
    (list(range(10)), "0, 1, 2, 3, 4, 5, 6, 7, 8, 9"),
    (list(range(1, 12)), "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ..."),
    (list(range(12)), "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ..."),
])
def test_non_finite_logits_are_named_token_by_token(bad, shown):
    """x_check_finite_logits__mutmut_2..20 (the list, its cut at 10, the ', ...' for more, the message)."""
    gate = NaiveGate(4, 3)
    with pytest.raises(ValueError, match=full(
            f"NaiveGate: the gate logits of {len(bad)} of 13 tokens are NaN or inf (token indices {shown}); the "
            "balancing loss of the whole batch would be NaN. Check those input rows (and the gate weights) for "
            "NaN/inf")):
        check_finite_logits(gate, nan_rows(13, bad))


def test_finite_and_empty_logits_pass():
    """x_check_finite_logits__mutmut_1 (an empty batch checked), 21 (shape[1])."""
    check_finite_logits(NaiveGate(4, 3), torch.zeros(0, 3))
    check_finite_logits(NaiveGate(4, 3), torch.zeros(5, 3))


def test_on_the_device_path_the_short_message_names_the_gate():
    """x_check_finite_logits__mutmut_24, 29..32: the device path's message."""
    with device_path(), pytest.raises(RuntimeError) as info:
        check_finite_logits(NoisyGate(4, 3), nan_rows(4, [2]))
    assert "NoisyGate: gate logits hold NaN or inf (checked on the device; run on the CPU to see which tokens)" \
        in str(info.value)


def test_noisy_gate_names_itself_for_nan_logits():
    """NoisyGate noisy_logits__mutmut_14 (check_finite_logits(None, ...))."""
    gate = NoisyGate(2, 2, top_k=1).eval()
    x = torch.tensor([[1.0, 0.0], [math.nan, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=full(
            "NoisyGate: the gate logits of 1 of 3 tokens are NaN or inf (token indices 1); the balancing loss of "
            "the whole batch would be NaN. Check those input rows (and the gate weights) for NaN/inf")):
        gate(x)


# -- BaseGate, NaiveGate ---------------------------------------------------------------------------------------

def test_base_gate_is_abstract_with_its_message():
    """xǁBaseGateǁforward__mutmut_1..4."""
    with pytest.raises(NotImplementedError, match=full("BaseGate is abstract: use NaiveGate, NoisyGate, GShardGate "
                                                       "or SwitchGate")):
        BaseGate(2, 1)(torch.zeros(1, 2))


def test_base_gate_loss_bookkeeping():
    """xǁBaseGateǁ__init__ (loss None, tot_expert a product), get_loss's clear default."""
    gate = BaseGate(3, 2)
    assert (gate.num_expert, gate.world_size, gate.tot_expert, gate.loss, gate.has_loss) == (3, 2, 6, None, False)
    gate.set_loss(torch.tensor(2.0))
    assert gate.get_loss(clear=False).item() == 2.0 and gate.has_loss
    assert gate.get_loss().item() == 2.0
    assert gate.loss is None and not gate.has_loss


def test_naive_gate_defaults():
    """xǁNaiveGateǁ__init____mutmut_1..3, 12, 19: world_size 1, top_k 2, a bias, d_model kept, bias=False honoured."""
    gate = NaiveGate(4, 3)
    assert (gate.world_size, gate.tot_expert, gate.top_k, gate.d_model) == (1, 3, 2, 4)
    assert gate.gate.bias is not None and tuple(gate.gate.weight.shape) == (3, 4)
    assert NaiveGate(4, 3, gate_bias=False).gate.bias is None


def naive_reference(logits: torch.Tensor, k: int):
    """Top-k by sorting each row (stable, best first) and a softmax written out."""
    order = torch.argsort(logits, dim=-1, descending=True, stable=True)[..., :k]
    vals = torch.gather(logits, -1, order)
    e = torch.exp(vals - vals.max(dim=-1, keepdim=True).values)
    return order, e / e.sum(dim=-1, keepdim=True)


def test_naive_gate_fed_logits_of_any_rank_works_on_the_last_dim():
    """xǁNaiveGateǁtop_k_logits__mutmut_17..25: with nn.Identity as the router (a student's swap) the logits may be
    (B, T, E); top-k and softmax run over E (dim=-1), silently (no implicit-dim softmax warning)."""
    gate = NaiveGate(4, 4, top_k=2)
    gate.gate = nn.Identity()
    logits = torch.tensor([[[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 1.0, 2.0], [0.0, 0.2, 0.4, 0.3]],
                           [[1.0, -2.0, 0.5, 0.7], [0.0, 0.3, 1.0, -1.0], [5.0, 4.0, 3.0, 2.0]]])   # (2, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idx, score, out = gate(logits, return_all_scores=True)
    want_idx, want_score = naive_reference(logits, 2)
    assert idx.tolist() == want_idx.tolist()
    torch.testing.assert_close(score, want_score, rtol=1e-6, atol=1e-7)
    assert out is logits


def test_naive_gate_output_and_dummy_loss():
    """xǁNaiveGateǁforward__mutmut_1..10: the pair by default, the dummy (1,) zero loss that needs a gradient."""
    torch.manual_seed(0)
    gate = NaiveGate(3, 4, top_k=2)
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gate(x)
    assert len(out) == 2
    want_idx, want_score = naive_reference(x @ gate.gate.weight.t() + gate.gate.bias, 2)
    assert out[0].tolist() == want_idx.tolist()
    torch.testing.assert_close(out[1], want_score, rtol=1e-5, atol=1e-6)
    loss = gate.get_loss()
    assert loss.shape == (1,) and loss.item() == 0.0 and loss.requires_grad


# -- cv_squared ------------------------------------------------------------------------------------------------

def test_cv_squared_values():
    """x_cv_squared__mutmut_1 (eps), 9..13: var (unbiased) / (mean^2 + 1e-10)."""
    torch.testing.assert_close(cv_squared(torch.tensor([1.0, 3.0])), torch.tensor(2.0 / (4.0 + 1e-10)))
    torch.testing.assert_close(cv_squared(torch.tensor([1, 2, 6])), torch.tensor(7.0 / 9.0))   # ints: as float
    # mean 0: the eps is the whole denominator, var 2e-12 / 1e-10 = 0.02
    torch.testing.assert_close(cv_squared(torch.tensor([1e-6, -1e-6])), torch.tensor(0.02), rtol=1e-4, atol=0)


@pytest.mark.parametrize("x", [torch.tensor([5.0], dtype=torch.float64), torch.zeros(0, dtype=torch.float16),
                               torch.tensor([3])])
def test_cv_squared_of_at_most_one_element_is_a_float32_zero_of_shape_1(x):
    """x_cv_squared__mutmut_2..8."""
    out = cv_squared(x)
    assert out.dtype == torch.float32 and out.shape == (1,) and out.item() == 0.0


def test_cv_squared_of_two_elements_is_computed():
    """x_cv_squared__mutmut_3 (<= 2 would give the zero for two elements)."""
    assert cv_squared(torch.tensor([0.0, 2.0])).item() == pytest.approx(2.0 / (1.0 + 1e-10))


# -- NoisyGate ---------------------------------------------------------------------------------------------------

def test_noisy_gate_defaults():
    """xǁNoisyGateǁ__init____mutmut_1..5, 14, 28, 29."""
    gate = NoisyGate(4, 3)
    assert (gate.world_size, gate.tot_expert, gate.top_k, gate.d_model) == (1, 3, 2, 4)
    assert (gate.noise_epsilon, gate.w_importance, gate.w_load) == (1e-2, 1.0, 1.0)
    assert tuple(gate.w_gate.shape) == tuple(gate.w_noise.shape) == (4, 3)


def test_noisy_gate_initialises_like_kaiming_uniform_a_sqrt5():
    """xǁNoisyGateǁreset_parameters: both weights drawn from U(-b, b) with b = 1/sqrt(fan_in), fan_in = E for a
    (d, E) tensor (torch reads dim 1 as the fan-in), gate first, then noise."""
    torch.manual_seed(3)
    gate = NoisyGate(6, 5)
    torch.manual_seed(3)
    b = 1 / math.sqrt(5)
    want_gate = torch.empty(6, 5).uniform_(-b, b)
    want_noise = torch.empty(6, 5).uniform_(-b, b)
    torch.testing.assert_close(gate.w_gate.detach(), want_gate)
    torch.testing.assert_close(gate.w_noise.detach(), want_noise)


def noisy_reference(gate: NoisyGate, x: torch.Tensor, noise: torch.Tensor | None):
    """fastmoe's NoisyGate written out: (idx (T*k,), score (T, 1, k), loss)."""
    k, E = gate.top_k, gate.tot_expert
    clean = x @ gate.w_gate
    if noise is None:
        stddev, logits = None, clean
    else:
        stddev = torch.log1p(torch.exp(x @ gate.w_noise)) + gate.noise_epsilon
        logits = clean + noise * stddev
    m = min(k + 1, E)
    order = torch.argsort(logits, dim=1, descending=True, stable=True)[:, :m]
    top = torch.gather(logits, 1, order)
    idx = order[:, :k]
    e = torch.exp(top[:, :k] - top[:, :1])
    score = e / e.sum(1, keepdim=True)
    gates = torch.zeros_like(logits).scatter(1, idx, score)

    def cv2(v):
        v = v.float()
        return v.var() / (v.mean() ** 2 + 1e-10) if v.numel() > 1 else torch.zeros(1)
    if noise is not None and k < E:
        normal = torch.distributions.Normal(0.0, 1.0)
        is_in = logits > top[:, k:k + 1]
        p = torch.where(is_in, normal.cdf((clean - top[:, k:k + 1]) / stddev),
                        normal.cdf((clean - top[:, k - 1:k]) / stddev))
        load = p.sum(0)
    else:
        load = (gates > 0).sum(0)
    loss = gate.w_importance * cv2(gates.sum(0)) + gate.w_load * cv2(load)
    return idx.reshape(-1), score.unsqueeze(1), loss, top


@pytest.mark.parametrize("k, E, wi, wl", [(2, 5, 1.0, 1.0), (1, 4, 0.5, 3.0), (3, 3, 1.0, 2.0)])
def test_noisy_gate_in_training_matches_the_formula(k, E, wi, wl):
    """NoisyGate forward / noisy_logits / top_k_choice / balance_loss / _prob_in_top_k: the noise is the one
    randn_like draw after the seed; ids, scores and the loss against the formula written above."""
    torch.manual_seed(11)
    gate = NoisyGate(3, E, top_k=k, w_importance=wi, w_load=wl, noise_epsilon=0.05)
    with torch.no_grad():
        gate.w_noise.mul_(4.0)
    x = torch.randn(7, 3)
    torch.manual_seed(5)
    noise = torch.randn(7, E)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idx, score = gate(x)
    want_idx, want_score, want_loss, _ = noisy_reference(gate, x.detach(), noise)
    assert idx.tolist() == want_idx.tolist()
    torch.testing.assert_close(score, want_score.detach(), rtol=1e-5, atol=1e-6)
    loss = gate.get_loss()
    torch.testing.assert_close(loss, want_loss.detach().reshape(loss.shape), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k, E", [(2, 5), (4, 4)])
def test_noisy_gate_in_eval_matches_the_formula(k, E):
    """Eval: no noise (stddev None), load = the plain count."""
    torch.manual_seed(2)
    gate = NoisyGate(3, E, top_k=k).eval()
    x = torch.randn(6, 3)
    idx, score = gate(x)
    want_idx, want_score, want_loss, _ = noisy_reference(gate, x, None)
    assert idx.tolist() == want_idx.tolist()
    torch.testing.assert_close(score, want_score.detach(), rtol=1e-5, atol=1e-6)
    loss = gate.get_loss()
    torch.testing.assert_close(loss, want_loss.detach().reshape(loss.shape), rtol=1e-4, atol=1e-6)


def test_noisy_top_k_choice_returns_k_plus_one_logits_capped_at_E():
    """xǁNoisyGateǁtop_k_choice__mutmut_6, 7 (k - 1, k + 2 logits), 16, 18 (implicit-dim softmax warns)."""
    gate = NoisyGate(2, 5, top_k=2)
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0], [9.0, 8.0, 7.0, 6.0, 5.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        top, idx, score = gate.top_k_choice(logits)
    assert top.tolist() == [[4.0, 3.0, 2.0], [9.0, 8.0, 7.0]]
    assert idx.tolist() == [[1, 3], [0, 1]]
    e = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(score, torch.tensor([[e, 1 - e], [e, 1 - e]]))
    full_gate = NoisyGate(2, 3, top_k=3)
    assert full_gate.top_k_choice(logits[:, :3])[0].shape == (2, 3)


def test_std_normal_cdf_is_normal_0_1s_cdf():
    """x__std_normal_cdf__mutmut_1..8 (2: 1.5 * (1 + erf) only scales the load, which cv² does not see)."""
    z = torch.tensor([-3.0, -1.0, -0.25, 0.0, 0.5, 2.0])
    torch.testing.assert_close(_std_normal_cdf(z), torch.distributions.Normal(0.0, 1.0).cdf(z))
    assert _std_normal_cdf(torch.tensor(0.0)).item() == 0.5


def test_prob_in_top_k_is_a_probability_per_token_and_expert():
    """xǁNoisyGateǁ_prob_in_top_k: Shazeer et al. eq. 9 on a hand-made case (k=1, E=3, one token).

    noisy = [2, 1, 0] (top-2 values 2, 1); clean = [1.5, 1, 0.5], stddev 1: expert 0 is in (noisy 2 > 1), its
    threshold is the 2nd value 1: Phi(0.5); experts 1, 2 are out, threshold the 1st value 2: Phi(-1), Phi(-1.5)."""
    gate = NoisyGate(2, 3, top_k=1)
    p = gate._prob_in_top_k(torch.tensor([[1.5, 1.0, 0.5]]), torch.tensor([[2.0, 1.0, 0.0]]), torch.ones(1, 3),
                            torch.tensor([[2.0, 1.0]]))
    normal = torch.distributions.Normal(0.0, 1.0)
    torch.testing.assert_close(p, normal.cdf(torch.tensor([[0.5, -1.0, -1.5]])))


# -- collect_aux_loss ------------------------------------------------------------------------------------------

class LossSource(nn.Module):
    def __init__(self, loss, has_loss=True):
        super().__init__()
        self.stored, self.has_loss, self.calls = loss, has_loss, []

    def get_loss(self, clear=False):
        self.calls.append(clear)
        return self.stored


def test_collect_aux_loss_sums_sources_and_passes_clear():
    """x_collect_aux_loss__mutmut_1 (clear default), 11..26: only modules with a callable get_loss AND has_loss;
    a (1,) loss and a float are summed as scalars."""
    a, b, c = LossSource(torch.tensor([1.5])), LossSource(2.0), LossSource(torch.tensor(100.0), has_loss=False)
    model = nn.Sequential(a, b, c, nn.Linear(2, 2))
    model.get_loss = 5                                                      # not callable: ignored
    model.has_loss = True
    out = collect_aux_loss(model)
    assert out.shape == () and out.item() == 3.5
    assert a.calls == [False] and b.calls == [False] and c.calls == []
    collect_aux_loss(model, clear=True)
    assert a.calls == [False, True]


def test_collect_aux_loss_skips_a_module_without_has_loss():
    """x_collect_aux_loss__mutmut_15, 18, 21 (getattr's default False changed): a get_loss without has_loss."""
    class NoFlag(nn.Module):
        def get_loss(self, clear=False):
            return torch.tensor(7.0)
    out = collect_aux_loss(nn.Sequential(NoFlag(), nn.Linear(2, 2)))
    assert out.shape == () and out.item() == 0.0


def test_collect_aux_loss_of_a_model_without_losses_is_a_0d_zero_on_the_weights_device():
    """x_collect_aux_loss__mutmut_27..34: a 0-d zero, on the first parameter's device (or the default)."""
    out = collect_aux_loss(nn.Linear(2, 2, device="meta"))
    assert out.shape == () and out.device.type == "meta"
    out = collect_aux_loss(nn.ReLU())
    assert out.shape == () and out.device.type == "cpu" and out.item() == 0.0
