"""What mutation testing (make mutate, labutils/moe/functions.py) found unpinned: each test kills a surviving
mutant, named in its docstring, with values worked out by hand."""
from __future__ import annotations

import pytest
import torch

from labutils.moe.functions import check_expert_ids, check_gate_output, check_top_k, combine, gather_combine


def test_a_non_int_top_k_names_its_type():
    """x_check_top_k__mutmut_4: the type in the message."""
    with pytest.raises(TypeError, match=r"^top_k must be an int, got 2\.0 \(float\)$"):
        check_top_k(2.0, 4)


@pytest.mark.parametrize(("idx", "score", "match"), [
    ([[0, 1]], torch.ones(1, 2), r"^the gate must return two tensors \(gate_top_k_idx, gate_score\)$"),
    (torch.zeros(1, 2, dtype=torch.long), [[1.0, 1.0]], r"^the gate must return two tensors"),
    (torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 3),
     r"^the gate returned gate_score of shape \(1, 3\); expected \(1, 2\)$"),
    (torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
     r"^gate_score must be floating point, got dtype torch\.int64$")])
def test_a_bad_gate_output_is_named(idx, score, match):
    """x_check_gate_output__mutmut_2, 7..9, 16, 17, 23: either output not a tensor, the messages' texts."""
    with pytest.raises(ValueError, match=match):
        check_gate_output(idx, score, 1, 2, 4)


def test_an_id_below_minus_one_is_refused():
    """x_check_expert_ids__mutmut_20: -1 means dropped; -2 is no expert."""
    """... and xǁcheck_expert_idsǁ mutmut_1/2: the default name is the gate's output's."""
    with pytest.raises(ValueError, match=r"^gate_top_k_idx holds expert ids in \[-2, 0\]; expected -1 "
                                        r"\(dropped\) or 0\.\.3"):
        check_expert_ids(torch.tensor([[-2, 0]]), 4)
    check_expert_ids(torch.tensor([[-1, 3]]), 4)          # the bounds themselves pass


def test_too_few_rows_name_the_row_count():
    """x_combine__mutmut_6, x_gather_combine__mutmut_8: the count in the message is of rows (dim 0)."""
    with pytest.raises(ValueError, match=r"^combine got 3 rows of expert output for 2 tokens x top_k=2$"):
        combine(torch.ones(3, 5), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^gather_combine got 3 rows for 2 positions"):
        gather_combine(torch.ones(3, 5), torch.tensor([0, 1]), torch.ones(2, 2))


@pytest.mark.parametrize("fused", [False, True])
def test_scores_keep_their_dtype_through_the_backward(fused):
    """xǁMOECombineǁforward__mutmut_12/32, backward__mutmut_22, xǁMOEGatherCombineǁforward__mutmut_3/80,
    backward__mutmut_25: float64 scores on float32 rows. The output is float32 and equals the hand sum; the
    scores' gradient is float64 and equals each row's dot with the output gradient (ones)."""
    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], requires_grad=True)   # (T*k, d) = (4, 2)
    score = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64, requires_grad=True)  # (T, k) = (2, 2)
    out = gather_combine(y, torch.arange(4), score) if fused else combine(y, score)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 4], [0.5 * 5 + 0.5 * 7, 0.5 * 6 + 0.5 * 8]]
    out.sum().backward()
    assert score.grad is not None and score.grad.dtype == torch.float64
    assert score.grad.tolist() == [[3.0, 7.0], [11.0, 15.0]]


def test_scores_without_a_gradient_give_none_for_them():
    """xǁMOEGatherCombineǁbackward__mutmut_17: the scores' gradient is None when they need none (not a value)."""
    y = torch.ones(4, 2, requires_grad=True)
    out = gather_combine(y, torch.arange(4), torch.full((2, 2), 0.5))
    out.sum().backward()
    assert y.grad is not None and y.grad.tolist() == [[0.5, 0.5]] * 4


def test_counts_list_reads_a_sequence_element_by_element():
    """x_counts_list__mutmut_2, 4: a list or tuple (no .tolist()) gives Python ints."""
    from labutils.moe.functions import counts_list
    out = counts_list((2.0, torch.tensor(0), 3))
    assert out == [2, 0, 3] and all(type(c) is int for c in out)
    assert counts_list(torch.tensor([1, 4])) == [1, 4]


def test_count_by_gate_keeps_token_order_within_an_expert():
    """x_count_by_gate__mutmut_1 (world_size default), 40, 41: argsort without stable=True reorders equal keys
    (CPU, 100 choices)."""
    from labutils.moe.functions import count_by_gate
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 4, (50, 2), generator=gen)
    flat = idx.reshape(-1).tolist()
    want = [i for e in range(4) for i in range(len(flat)) if flat[i] == e]
    pos, counts = count_by_gate(idx, 2, world_size=2)
    assert pos.tolist() == want
    assert counts.tolist() == [flat.count(e) for e in range(4)]
    pos_all, counts_all = count_by_gate(idx, 4, keep_dropped=True)                # world_size 1 by default
    assert pos_all.tolist() == want + [i for i in range(len(flat)) if flat[i] == -1]
    assert counts_all.tolist() == [flat.count(e) for e in range(4)]


@pytest.mark.parametrize(("num_expert", "world_size", "text"), [
    (0, 1, "count_by_gate: num_expert must be an int >= 1, got 0"),
    (2, 0, "count_by_gate: world_size must be an int >= 1, got 0"),
    (2, True, "count_by_gate: world_size must be an int >= 1, got True")])
def test_count_by_gate_names_the_bad_size(num_expert, world_size, text):
    """x__tot_expert__mutmut_3..10: each size's name in the message."""
    import re

    from labutils.moe.functions import count_by_gate
    with pytest.raises(ValueError, match="^" + re.escape(text) + "$"):
        count_by_gate(torch.zeros(2, 1, dtype=torch.long), num_expert, world_size)


def test_the_inverse_permutation_is_made_on_pos_device():
    """xǁMOEGatherǁforward__mutmut_13, 15, xǁMOEGatherCombineǁforward__mutmut_16, 18: the arange of the inverse
    permutation without device=pos.device is made on the CPU; on the meta device (no data, any machine)
    index_copy_ then refuses to mix devices, as it would on a GPU."""
    from labutils.moe.functions import gather
    y = torch.empty(4, 3, device="meta")
    pos = torch.tensor([2, 0, 3, 1]).to("meta")
    out = gather(y, pos, 4)
    assert out.device.type == "meta" and out.shape == (4, 3)
    out = gather_combine(y, pos, torch.empty(2, 2, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3)


@pytest.mark.parametrize("tot_expert", [0, True])
def test_no_expert_is_refused_even_for_an_empty_batch(tot_expert):
    """x_check_expert_ids__mutmut_3 (0 passes when `not Integral and < 1`), 4 (True passes when `bool and ...`)."""
    with pytest.raises(ValueError, match=rf"^gate_top_k_idx: num_expert \* world_size = {tot_expert!r}: there is no "
                                         r"expert to route to; num_expert and world_size must each be an int >= 1$"):
        check_expert_ids(torch.zeros(0, dtype=torch.long), tot_expert)


def test_check_expert_ids_on_the_device_path_stops_with_its_own_message():
    """check_expert_ids' device-path message (torch._assert_async raises it on the CPU), an id equal to
    tot_expert refused on both paths, and the dtype error's full text with the error type asked for."""
    from labutils.moe.device_path import device_path

    with device_path():
        for bad in (3, -2):
            with pytest.raises(RuntimeError) as err:
                check_expert_ids(torch.tensor([0, bad]), 3)
            assert str(err.value) == "gate_top_k_idx: an expert id is outside -1..2 (num_expert * world_size - 1)"
        with pytest.raises(RuntimeError) as err:
            check_expert_ids(torch.tensor([[4]]), 4, name="idx")
        assert str(err.value) == "idx: an expert id is outside -1..3 (num_expert * world_size - 1)"
        check_expert_ids(torch.tensor([-1, 0, 2]), 3)                    # the bounds pass
    with pytest.raises(ValueError) as err:
        check_expert_ids(torch.tensor([0, 3]), 3)
    assert str(err.value) == ("gate_top_k_idx holds expert ids in [0, 3]; expected -1 (dropped) or 0..2 "
                              "(num_expert * world_size - 1)")
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError) as err:
            check_expert_ids(torch.tensor([1], dtype=dtype), 3, name="ids", dtype_error=TypeError)
        assert str(err.value) == f"ids must hold integer expert ids, got dtype {dtype}"
    with pytest.raises(ValueError) as err:
        check_expert_ids(torch.tensor([1.0]), 3)
    assert str(err.value) == "gate_top_k_idx must hold integer expert ids, got dtype torch.float32"
