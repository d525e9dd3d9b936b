"""labutils.moe.reference, the brute-force references the fast path is checked against, pinned by hand values.
Mutation testing (make mutate, labutils/moe/reference.py) found the parts no other test reached."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from labutils.moe import FMoE
from labutils.moe.reference import expert_on_token, reference_count_by_gate, reference_moe, reference_topk_gate


def test_topk_gate_by_hand_ties_go_to_the_lower_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],                           # a tie: 1 before 2
                           [0.0, 2.0, 1.0, -1.0],
                           [5.0, -5.0, 0.0, 4.0]])
    idx, score = reference_topk_gate(logits, 2)
    assert idx.tolist() == [[1, 2], [1, 2], [0, 3]]
    s = 1 / (1 + torch.exp(torch.tensor(-1.0))).item()                       # softmax([a, a - 1])[0]
    torch.testing.assert_close(score, torch.tensor([[0.5, 0.5], [s, 1 - s], [s, 1 - s]]))


def test_count_by_gate_reference_is_long_even_when_empty():
    pos, counts = reference_count_by_gate(torch.tensor([[-1, -1]]), 0)
    assert pos.dtype == counts.dtype == torch.long and pos.numel() == counts.numel() == 0
    pos, counts = reference_count_by_gate(torch.tensor([[2, 0], [0, -1]]), 3)
    assert pos.tolist() == [1, 2, 0] and counts.tolist() == [2, 0, 1]


class _CountedExpert(nn.Module):
    """fastmoe's expert signature, expert(x, count): scales by the count it is given, so a wrong count shows."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x, fwd_expert_count):
        return x * self.scale * fwd_expert_count.sum()


def test_an_expert_that_takes_the_count_is_given_one_row():
    layer = FMoE(d_model=3, top_k=1, expert=[lambda d: _CountedExpert(2.0), lambda d: _CountedExpert(-1.0)])
    x_t = torch.tensor([1.0, 2.0, 3.0])
    assert expert_on_token(layer, 0, x_t).tolist() == [2.0, 4.0, 6.0]
    assert expert_on_token(layer, 1, x_t).tolist() == [-1.0, -2.0, -3.0]


def test_reference_moe_weights_experts_skips_drops_and_keeps_empty_inputs():
    layer = FMoE(d_model=2, top_k=2, expert=[lambda d: _CountedExpert(1.0), lambda d: _CountedExpert(10.0)])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = reference_moe(layer, x, torch.tensor([[0, 1], [1, -1]]), torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    assert y.tolist() == [[7.75, 15.5], [15.0, 20.0]]            # 0.25*x + 7.5*x; 5*x (the -1 adds nothing)
    empty = reference_moe(layer, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 2)


def test_reference_moe_wants_ids_and_scores_together():
    whole = "reference_moe: pass gate_idx and gate_score together (or neither, to call layer.gate)"
    layer = FMoE(d_model=2, top_k=1, expert=[lambda d: _CountedExpert(1.0)])
    with pytest.raises(ValueError, match="^" + re.escape(whole) + "$"):
        reference_moe(layer, torch.ones(1, 2), torch.zeros(1, 1, dtype=torch.long), None)


def test_topk_gate_ties_go_to_the_lower_index_in_long_rows_too():
    """32 equal logits: an unstable sort (CPU's for rows of 17 or more) would put index 16 first."""
    idx, score = reference_topk_gate(torch.zeros(2, 32), 3)
    assert idx.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(score, torch.full((2, 3), 1 / 3))


def test_reference_moe_takes_ids_of_any_shape_holding_k_per_token_even_with_no_tokens():
    """gate ids and scores are reshaped to (T, k): top-1 ids may come as (T,), also when T is 0."""
    layer = FMoE(d_model=2, top_k=1, expert=[lambda d: _CountedExpert(1.0), lambda d: _CountedExpert(10.0)])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = reference_moe(layer, x, torch.tensor([1, 0]), torch.tensor([0.5, 2.0]))
    assert y.tolist() == [[5.0, 10.0], [6.0, 8.0]]
    empty = reference_moe(layer, torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert empty.shape == (0, 2)
