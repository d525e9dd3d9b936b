"""Bad input to the gates (issue 19): a clear error naming the bad value, a warning where a value is legal but
useless, never a silently wrong number. Each case failed (silently or obscurely) before the fix."""
import re

import pytest
import torch

from labutils.moe import (
    DCGate,
    FMoETransformerMLP,
    GShardGate,
    NaiveGate,
    NoisyGate,
    SwipeGate,
    SwitchGate,
    ZeroGate,
    drop_over_capacity,
    limit_by_capacity,
)

D, E = 8, 4
CAPACITY_GATES = [(GShardGate, 2), (SwitchGate, 1), (DCGate, 2)]
ALL_GATES = [(NaiveGate, 2), (NoisyGate, 2), (ZeroGate, 2), (SwipeGate, 2)] + CAPACITY_GATES
ids = lambda v: getattr(v, "__name__", str(v))  # noqa: E731


@pytest.mark.parametrize("gate,k", CAPACITY_GATES, ids=ids)
@pytest.mark.parametrize("capacity", [0, -1.0, (1.2, 0), (float("nan"), 2.4), (1.2, float("inf"))], ids=str)
def test_capacity_factor_must_be_finite_and_positive(gate, k, capacity):
    with pytest.raises(ValueError, match=r"capacity factors must be finite and > 0, got " + re.escape(repr(capacity))):
        gate(D, E, 1, k, capacity=capacity)


@pytest.mark.parametrize("gate,k", CAPACITY_GATES, ids=ids)
@pytest.mark.parametrize("capacity", ["1.2", (1.2,), (1, 2, 3), True], ids=str)
def test_capacity_of_the_wrong_type(gate, k, capacity):
    with pytest.raises(TypeError, match="capacity must be a number or a \\(train, eval\\) pair"):
        gate(D, E, 1, k, capacity=capacity)


@pytest.mark.parametrize("gate,k", CAPACITY_GATES, ids=ids)
def test_scalar_capacity_is_used_for_train_and_eval(gate, k):
    torch.manual_seed(0)
    scalar = gate(D, E, 1, k, capacity=1.5)
    torch.manual_seed(0)
    pair = gate(D, E, 1, k, capacity=(1.5, 1.5))
    assert scalar.capacity == (1.5, 1.5)
    x = torch.randn(20, D)
    for train in (True, False):
        torch.manual_seed(1)
        a = scalar.train(train)(x)
        torch.manual_seed(1)
        b = pair.train(train)(x)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_capacity_below_one_token_per_expert_warns():
    gate = GShardGate(D, 8, 1, 2, capacity=0.1)                 # floor(ceil(0.4)*2/8) = 0
    with pytest.warns(UserWarning, match=r"gives 0 tokens per expert \(< 1\): every choice is dropped"):
        idx, _ = gate(torch.randn(4, D))
    assert (idx == -1).all()


@pytest.mark.parametrize("capacity", [-1, float("nan"), float("inf"), 2.5, torch.tensor([1, -2, 3, 4]),
                                      torch.tensor([1.0, float("nan"), 1.0, 1.0])], ids=str)
def test_limit_by_capacity_rejects_bad_counts(capacity):
    idx = torch.randint(0, E, (10, 2))
    with pytest.raises(ValueError, match="whole numbers of tokens >= 0"):
        drop_over_capacity(idx, E, capacity)
    with pytest.raises(ValueError, match="whole numbers of tokens >= 0"):
        limit_by_capacity(idx, E, world_size=1, capacity=capacity)


def test_limit_by_capacity_rejects_a_wrong_number_of_capacities():
    with pytest.raises(ValueError, match="scalar or have 4 entries"):
        limit_by_capacity(torch.zeros(3, 2, dtype=torch.long), E, world_size=1, capacity=torch.tensor([1, 2]))


@pytest.mark.parametrize("gate,k", [(NoisyGate, 2)] + CAPACITY_GATES, ids=ids)
def test_one_nan_token_names_the_token_instead_of_a_nan_loss(gate, k):
    torch.manual_seed(0)
    g = gate(D, E, 1, k)
    x = torch.randn(12, D)
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    with pytest.raises(ValueError, match=r"2 of 12 tokens are NaN or inf \(token indices 3, 7\)"):
        g(x)


def test_nan_token_through_the_layer():
    layer = FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=16, top_k=2, gate=GShardGate)
    x = torch.randn(2, 5, D)
    x[1, 2] = float("nan")                                          # token 7 of the flattened batch
    with pytest.raises(ValueError, match="token indices 7"):
        layer(x)


@pytest.mark.parametrize("gate,k", ALL_GATES, ids=ids)
def test_top_k_must_be_an_int(gate, k):
    with pytest.raises(TypeError, match=f"top_k must be an int, got {float(k)}"):
        gate(D, E, 1, float(k))


@pytest.mark.parametrize("gate", [NaiveGate, NoisyGate, ZeroGate, SwipeGate, GShardGate, DCGate], ids=ids)
def test_top_k_above_the_number_of_experts(gate):
    with pytest.raises(ValueError, match=r"top_k=3 must be between 1 and the number of experts .* = 2\)"):
        gate(D, 1, 2, 3)


@pytest.mark.parametrize("gate,k", ALL_GATES, ids=ids)
@pytest.mark.parametrize("shape", [(5, D + 1), (2, 5, D), (D,)], ids=str)
def test_wrong_input_shape_names_d_model(gate, k, shape):
    g = gate(D, E, 1, k)
    with pytest.raises(ValueError, match=rf"got input of shape \({', '.join(map(str, shape))},?\); "
                                         rf"expected \(tokens, d_model={D}\)"):
        g(torch.randn(shape))


@pytest.mark.parametrize("gate,k", [g for g in ALL_GATES if g[0] is not ZeroGate], ids=ids)
def test_input_dtype_must_match_the_gate(gate, k):
    g = gate(D, E, 1, k)
    with pytest.raises(TypeError, match="torch.float32 weights but got a torch.float64 input"):
        g(torch.randn(5, D, dtype=torch.float64))
