"""What mutation testing (make mutate, labutils/moe/capacity.py) found unpinned: each test kills a surviving
mutant, named in its docstring, with a value worked out by hand (never by calling the formula under test)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from labutils.moe.capacity import (
    CapacityFactors,
    capacity_factors,
    deepspeed_capacity,
    deepspeed_dropless_capacity,
    drop_over_capacity,
    exact_capacity,
    exchange_counts,
    expert_capacity,
    fastmoe_dc_capacity,
    fastmoe_gshard_capacity,
    fastmoe_switch_capacity,
    limit_by_capacity,
    position_in_expert,
    token_choice_capacity,
)
from labutils.moe.capacity_gates import GShardGate


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


# -- issue 38, second pass: the survivors of the code since (names as mutmut 3.8 numbers the current file) ------

def _full(text: str) -> str:
    import re
    return "^" + re.escape(text) + "$"


@pytest.mark.parametrize(("call", "want"), [
    (lambda: deepspeed_capacity(8, 4, 0.0), 0), (lambda: exact_capacity(8, 4, 0), 0),
    (lambda: token_choice_capacity(8, 4, 0.0, 2), 0),
    (lambda: fastmoe_gshard_capacity(8, 0.0, 2, 4), 0),
    (lambda: fastmoe_switch_capacity(8, 0.0, 2), 0),
    (lambda: fastmoe_dc_capacity(8, 0.0), 0)])
def test_a_factor_of_zero_is_accepted_where_the_bound_is_at_least_zero(call, want):
    """x__check_args__mutmut_15, 20 (> 0 for every formula), 21: a factor of 0 is legitimate (capacity 0)."""
    assert call() == want


def test_the_factor_errors_in_full():
    """x__check_args__mutmut_3..7, 17, 18, 23: '>= 0' and '> 0' (expert choice) named with the value."""
    with pytest.raises(ValueError, match=_full("deepspeed_capacity: capacity_factor must be a finite number >= 0, "
                                               "got -1")):
        deepspeed_capacity(8, 4, -1)
    with pytest.raises(ValueError, match=_full("fastmoe_dc_capacity: factor must be a finite number >= 0, got nan")):
        fastmoe_dc_capacity(8, float("nan"))
    with pytest.raises(ValueError, match=_full("expert_capacity: capacity_factor must be a finite number > 0, "
                                               "got 0.0")):
        expert_capacity(8, 4, 0.0)
    assert expert_capacity(8, 4, 0.5) == 1                          # ceil(8 * 0.5 / 4) = 1, a factor below 1 ok


@pytest.mark.parametrize("counts", [torch.tensor([True, False]), torch.tensor([1 + 0j, 2 + 0j]),
                                    torch.tensor([1.0, float("inf")]), torch.tensor([]), torch.tensor([2, -1]),
                                    torch.tensor([1.5, 2.0]), torch.tensor([float("nan")])])
def test_bad_local_expert_counts_are_refused_in_full(counts):
    """x__check_args__mutmut_29..45: bool, complex, inf, empty, negative, fractional, NaN counts."""
    with pytest.raises(ValueError, match=_full(
            "deepspeed_dropless_capacity: local_expert_counts must be a non-empty (W, E) or (E,) tensor of counts "
            f"(whole numbers >= 0), got {counts!r}")):
        deepspeed_dropless_capacity(counts)


def test_dropless_capacity_is_the_largest_count():
    """x__check_args__mutmut_41 (a 0 count refused), 34/35: whole-number counts of any real dtype."""
    assert deepspeed_dropless_capacity(torch.tensor([[0, 3], [2, 1]])) == 3
    assert deepspeed_dropless_capacity(torch.tensor([0.0, 0.0])) == 0
    assert deepspeed_dropless_capacity([4, 1]) == 4


@pytest.mark.parametrize(("capacity", "error", "text"), [
    (True, TypeError, "drop_over_capacity: capacity must be an int or a tensor of 3 ints, got True"),
    ("2", TypeError, "drop_over_capacity: capacity must be an int or a tensor of 3 ints, got '2'"),
    (torch.tensor([[1, 1, 1]]), ValueError, "drop_over_capacity: capacity must be a scalar or have 3 entries, got "
                                            "shape (1, 3)"),
    (torch.tensor([1, 1]), ValueError, "drop_over_capacity: capacity must be a scalar or have 3 entries, got "
                                       "shape (2,)"),
    (torch.tensor([1.0, float("inf"), 1.0]), ValueError, "drop_over_capacity: capacity must hold whole numbers "
                                                         "of tokens >= 0, got tensor([1., inf, 1.])"),
    (-1, ValueError, "drop_over_capacity: capacity must hold whole numbers of tokens >= 0, got -1"),
    (0.5, ValueError, "drop_over_capacity: capacity must hold whole numbers of tokens >= 0, got 0.5")])
def test_a_bad_capacity_is_refused_in_full(capacity, error, text):
    """x__token_counts__mutmut_1..27: each branch of the capacity check, with its whole message."""
    with pytest.raises(error, match=_full(text)):
        drop_over_capacity(torch.tensor([[0, 1], [2, 0]]), 3, capacity)


def test_capacity_zero_or_per_expert_is_accepted():
    """x__token_counts__mutmut_9 (a 1-D capacity refused), 12..14, 23 (0 refused)."""
    idx = torch.tensor([[0, 1], [2, 0], [0, 2]])
    assert drop_over_capacity(idx, 3, 0).tolist() == [[-1, -1]] * 3
    assert drop_over_capacity(idx, 3, torch.tensor([2, 0, 1])).tolist() == [[0, -1], [2, -1], [0, -1]]
    assert drop_over_capacity(idx, 3, torch.tensor(1.0)).tolist() == [[0, 1], [2, -1], [-1, -1]]


def test_limit_by_capacity_counts_are_int64_for_a_float_capacity():
    """x__token_counts__mutmut_29 (.to(None) keeps a float capacity float: new_gec/new_lec float)."""
    idx = torch.tensor([[0, 1], [1, 0], [1, 1]])
    new_lec, new_gec, out = limit_by_capacity(idx, 2, world_size=1, capacity=2.0)
    assert new_lec.dtype == new_gec.dtype == torch.int64
    assert new_lec.tolist() == new_gec.tolist() == [2, 2]
    assert out.tolist() == [[0, -1], [1, 0], [1, -1]]  # first choices first


def test_position_in_expert_ranks_by_column_then_token():
    """x_position_in_expert__mutmut_*: every expert used (the last one too), drops (-1) in between."""
    idx = torch.tensor([[2, 0], [-1, 2], [2, 1], [0, -1]])
    assert position_in_expert(idx, 3).tolist() == [[0, 1], [-1, 2], [1, 0], [0, -1]]
    assert position_in_expert(torch.tensor([[-1], [-1]]), 1).tolist() == [[-1], [-1]]


class _FakeRank1:
    """torch.distributed for rank 1 of 2: all_to_all_single swaps in rank 0's scripted send buffers."""

    def __init__(self, sends):
        self.sends, self.calls = list(sends), []

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        half = input.numel() // 2
        self.calls.append((tuple(output.shape), output.dtype, input.tolist(), group))
        output.copy_(torch.cat([torch.tensor(self.sends.pop(0))[half:], input[half:]]))


def _fake_world(monkeypatch, sends):
    import labutils.moe.capacity as capacity
    fake = _FakeRank1(sends)
    checked = []
    monkeypatch.setattr(capacity, "dist", fake)
    monkeypatch.setattr(capacity, "require_process_group", lambda *a, **kw: checked.append((a, kw)))
    return fake, checked


def test_exchange_counts_checks_the_group_and_sends_block_w_to_rank_w(monkeypatch):
    """x_exchange_counts__mutmut_1..16: the check's arguments, and all_to_all_single(out, counts, group=group)."""
    group = object()
    fake, checked = _fake_world(monkeypatch, [[7, 8, 9, 10]])
    counts = torch.tensor([1, 2, 3, 4])
    out = exchange_counts(counts, 2, group)
    assert out.tolist() == [9, 10, 3, 4] and counts.tolist() == [1, 2, 3, 4]
    assert checked == [((group, 2, "exchanging expert counts over world_size=2 workers"), {})]
    assert fake.calls == [((4,), torch.int64, [1, 2, 3, 4], group)]
    one = exchange_counts(counts, 1)                                     # one worker: a copy, no collective
    assert one.tolist() == [1, 2, 3, 4] and one is not counts and len(fake.calls) == 1


def test_limit_by_capacity_over_two_workers(monkeypatch):
    """x_limit_by_capacity__mutmut_55..97: rank 1 of 2, 2 experts each, capacity 3 per local expert.

    My choices per global expert (lec) = [1, 1, 3, 1]; rank 0 sends my experts (2, 3) [2, 0], so gec =
    [[2, 0], [3, 1]]; before = [[0, 0], [2, 0]]; room = [[3, 3], [1, 3]]; new_gec = [2, 0, 1, 1]. Rank 0's experts
    accept [1, 1] of mine, so new_lec = [1, 1, 1, 1]: each expert keeps my first arrival only."""
    group = object()
    fake, checked = _fake_world(monkeypatch, [[5, 5, 2, 0], [9, 9, 1, 1]])
    idx = torch.tensor([[0, 2], [2, 3], [1, 2]])
    new_lec, new_gec, out = limit_by_capacity(idx, 2, world_size=2, capacity=3, group=group)
    assert new_gec.tolist() == [2, 0, 1, 1]
    assert new_lec.tolist() == [1, 1, 1, 1]
    assert out.tolist() == [[0, -1], [2, 3], [1, -1]]
    assert [c[2] for c in fake.calls] == [[1, 1, 3, 1], [2, 0, 1, 1]]
    assert [c[3] for c in fake.calls] == [group, group]
    assert [a for a, _ in checked] == [(group, 2, "exchanging expert counts over world_size=2 workers")] * 2


def test_a_small_capacity_warns_at_the_callers_line():
    """x_warn_small_capacity__mutmut_6..10: the whole message, and stacklevel=3 (the caller of
    capacity_per_expert: this test)."""
    import warnings

    gate = GShardGate(4, 8, capacity=(0.1, 0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gate.capacity_per_expert(1) == 0                      # floor(ceil(0.1) * 2 / 8)
    assert [str(w.message) for w in caught] == [
        "GShardGate: capacity factor 0.1 with 1 tokens gives 0 tokens per expert (< 1): every choice is dropped; "
        "raise the factor or the batch"]
    # stacklevel=3 counts frames. Under mutmut (the package imported from its mutants/ copy) a trampoline sits
    # between the functions it mutates and their callers, so the same stacklevel names capacity_gates.py, this file
    # or mutmut's trampoline module (when capacity_gates.py is mutated); never capacity.py (stacklevel 1, or 2)
    import labutils.moe.capacity as capacity
    import labutils.moe.capacity_gates as capacity_gates
    if "mutants" not in pathlib.Path(capacity.__file__).parts:
        assert caught[0].filename == __file__
    else:
        trampoline = pathlib.Path(caught[0].filename).parts[-3:] == ("mutmut", "mutation", "trampoline.py")
        assert caught[0].filename in (capacity_gates.__file__, __file__) or trampoline, caught[0].filename
        assert caught[0].filename != capacity.__file__


def test_the_capacity_descriptor_on_the_class_is_itself():
    """xǁCapacityFactorsǁ__get____mutmut_1..3; __set__ checks and names the gate's class."""
    assert isinstance(GShardGate.capacity, CapacityFactors)
    gate = GShardGate(4, 2)
    assert gate.capacity == (1.2, 2.4)
    gate.capacity = 3
    assert gate.capacity == (3.0, 3.0)
    with pytest.raises(ValueError, match=r"^GShardGate\.capacity: capacity factors must be finite and > 0, "
                                         r"got \(0, 1\)"):
        gate.capacity = (0, 1)


def test_deepspeed_capacity_multiplies_by_k():
    """x_deepspeed_capacity__mutmut_19: cf / k instead of cf * k. ceil(10 / 4 * float32(1.0 * 2)) = 5 (the
    division: ceil(1.25) = 2); the float32 product of the docstring: S=100, E=4, cf=1.2 gives 31, not 30."""
    assert deepspeed_capacity(10, 4, 1.0, k=2) == 5
    assert deepspeed_capacity(100, 4, 1.2) == 31
    assert deepspeed_capacity(0, 4, 1.2, min_capacity=4) == 4


@pytest.mark.parametrize("capacity", [(1, 2, 3), range(1, 3), (True, 1.0), ("a", 1.0), [1.0]])
def test_capacity_factors_takes_a_number_or_a_pair_of_numbers_only(capacity):
    """x_capacity_factors__mutmut_5 (three numbers), 6 (a range of two ints is no pair), 10 (a bool, a string)."""
    with pytest.raises(TypeError, match=_full(f"Gate: capacity must be a number or a (train, eval) pair of numbers, "
                                              f"got {capacity!r}")):
        capacity_factors(capacity, "Gate")
    assert capacity_factors([1, 2.5], "Gate") == (1.0, 2.5)


def test_the_small_capacity_warning_asks_for_stacklevel_3(monkeypatch):
    """x_warn_small_capacity__mutmut_10: the frame test above reads the line named in the normal layout; under
    mutmut a trampoline adds frames, so here the argument itself is read (3: past warn_small_capacity and the
    gate's capacity_per_expert, to the line that asked for the capacity)."""
    import types

    import labutils.moe.capacity as capacity

    calls = []
    monkeypatch.setitem(vars(capacity), "warnings",
                        types.SimpleNamespace(warn=lambda message, **kw: calls.append((message, kw))))
    GShardGate(4, 8, capacity=(0.1, 0.1)).capacity_per_expert(1)
    assert [kw for _, kw in calls] == [{"stacklevel": 3}]
