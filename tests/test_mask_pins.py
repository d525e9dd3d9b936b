"""What mutation testing (make mutate, labutils/moe/mask.py) found unpinned: each test kills surviving mutants,
named in its docstring, with values worked out by hand."""
from __future__ import annotations

import re

import pytest
import torch

from labutils.moe.mask import check_mask, check_mask_pair, fill_masked


def test_one_of_mask_and_mask_dict_alone_is_refused_in_full_words():
    """x_check_mask_pair__mutmut_5, 7, 8: the whole message, first word to last."""
    whole = ("mask and mask_dict go together: mask marks rows (0 = run the experts, key = take mask_dict[key]); "
             "fastmoe silently ignores one without the other")
    for mask, mask_dict in ((torch.zeros(2), None), (None, {1: torch.zeros(3)})):
        with pytest.raises(ValueError, match="^" + re.escape(whole) + "$"):
            check_mask_pair(mask, mask_dict)
    check_mask_pair(None, None)


def test_a_mask_value_missing_from_mask_dict_is_refused_in_full_words():
    """x_check_mask__mutmut_22..25: the whole message, first word to last."""
    whole = ("mask holds value(s) [2] that mask_dict has no entry for (its keys: [1]): each nonzero mask value "
             "must be a key of mask_dict, whose value replaces the experts' output for those rows; 0 marks the "
             "rows that run the experts")
    with pytest.raises(ValueError, match="^" + re.escape(whole) + "$"):
        check_mask(torch.tensor([0, 1, 2]), {1: torch.zeros(4)}, 3)


def test_tensor_keys_of_mask_dict_match_mask_values():
    """x_check_mask__mutmut_13, 15: a key given as a 0-d tensor is the same key as its number."""
    mask = check_mask(torch.tensor([0, 3, 0]), {torch.tensor(3): torch.ones(4)}, 3)
    assert mask.tolist() == [0, 3, 0]


def test_fill_masked_keeps_y_dtype_for_a_list_value():
    """x_fill_masked__mutmut_35, 36: a mask_dict value given as a list of numbers takes y's dtype (float64 here;
    torch.as_tensor alone would make float32, which index_put refuses beside float64)."""
    y = torch.arange(8, dtype=torch.float64).view(4, 2)                      # (T_kept*k, d): 2 kept rows, k 2
    out = fill_masked(y, torch.tensor([0, 5, 0]), {5: [7.0, 9.0]}, k=2)       # (T*k, d) = (6, 2)
    assert out.dtype == torch.float64
    assert out.tolist() == [[0, 1], [2, 3], [7, 9], [7, 9], [4, 5], [6, 7]]

