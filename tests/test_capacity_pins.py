"""What mutation testing (make mutate, labutils/moe/capacity.py) found unpinned: each test kills a surviving
mutant, named in its docstring, with a value worked out by hand (never by calling the formula under test)."""
from __future__ import annotations

import pytest
import torch

from labutils.moe.capacity import deepspeed_capacity, drop_over_capacity, exact_capacity, limit_by_capacity


@pytest.mark.parametrize("fn", [deepspeed_capacity, exact_capacity])
def test_a_negative_min_capacity_is_refused_by_name(fn):
    """x_deepspeed_capacity__mutmut_14, x_exact_capacity__mutmut_14: min_capacity left out of the check."""
    with pytest.raises(ValueError, match=rf"{fn.__name__}: min_capacity must be .*got -1"):
        fn(8, 4, 1.0, k=1, min_capacity=-1)


def test_exact_capacity_multiplies_by_k():
    """x_exact_capacity__mutmut_20: cf / k instead of cf * k. ceil(1.0 * 2 * 10 / 4) = 5 (the division: 2)."""
    assert exact_capacity(10, 4, 1.0, k=2) == 5
    assert exact_capacity(10, 4, 1.25, k=3) == 10                  # ceil(1.25 * 3 * 10 / 4) = ceil(9.375)


def test_the_020_call_with_keywords_too_is_refused_with_its_reason():
    """x_limit_by_capacity__mutmut_10..12: the TypeError's text was never pinned."""
    idx = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(TypeError, match=r"^limit_by_capacity: a third positional argument is the 0\.2\.0 call "
                                        r"\(gate_idx, tot_expert, capacity\); pass world_size= and capacity= as "
                                        r"keywords only$"):
        limit_by_capacity(idx, 2, 1, world_size=1)


def test_drop_over_capacity_takes_a_flat_index_too():
    """x_drop_over_capacity__mutmut_18..27: a 1-D ``gate_idx`` (T,) was never passed. Three tokens, two on expert
    0 with room for one: the later one is dropped, and the result keeps the input's shape."""
    out = drop_over_capacity(torch.tensor([0, 0, 1]), 2, 1)
    assert out.tolist() == [0, -1, 1]
    assert drop_over_capacity(torch.tensor([1]), 2, 0).tolist() == [-1]


@pytest.mark.parametrize(("call", "name"), [
    (lambda: drop_over_capacity(torch.tensor([[0]]), 2, -1), "drop_over_capacity"),
    (lambda: limit_by_capacity(torch.tensor([[0]]), 2, world_size=1, capacity=1.5), "limit_by_capacity")])
def test_a_bad_capacity_names_the_function_it_was_given_to(call, name):
    """x_drop_over_capacity__mutmut_10/14/15, x_limit_by_capacity__mutmut_36/40/41: the error's function name."""
    with pytest.raises(ValueError, match=rf"^{name}: capacity must hold whole numbers of tokens >= 0"):
        call()


def test_limit_by_capacity_without_its_keywords_names_the_signature():
    """x_limit_by_capacity__mutmut_25: the text of the missing-keywords error."""
    with pytest.raises(TypeError, match=r"^limit_by_capacity\(topk_idx, num_expert, \*, world_size, capacity, "
                                        r"group=None\) needs world_size= and capacity=, got world_size=None"):
        limit_by_capacity(torch.tensor([[0]]), 2)


@pytest.mark.parametrize(("capacity", "tokens", "warns"), [(0, 1, True), (1, 1, False), (0, 0, False),
                                                          (1, 0, False), (0, 2, True)])
def test_a_capacity_below_one_warns_only_when_tokens_would_all_drop(capacity, tokens, warns):
    """x_warn_small_capacity__mutmut_1..5: the condition ``capacity < 1 and num_tokens > 0``, case by case."""
    import warnings

    from labutils.moe.capacity import warn_small_capacity

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_small_capacity("Gate", capacity, 0.1, tokens)
    assert [str(w.message).startswith("Gate: capacity factor 0.1") for w in caught] == ([True] if warns else [])
