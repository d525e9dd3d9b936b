"""labutils.collectives on 2 and 3 in-process ranks (tests/threaded_ranks.py): every collective forward and
backward, with ``group=`` a subgroup, and the clear errors when ranks disagree, raised alike on every rank.

Expected values are written by hand or built by plain loops over the ranks' inputs; tests/test_dist.py runs the
same collectives on gloo workers (the reference for the wire). Rows carry their origin in their values
(``100 * source rank + 10 * destination + j``), so a row in the wrong place shows which one it is."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks

from labutils.agreement import CollectiveMismatch
from labutils.collectives import (
    AllGather,
    AllGatherFunction,
    Slice,
    all_gather,
    all_gather_same_dim,
    all_gather_variable_dim,
    all_to_all,
    gather_sizes,
    pad_dim_to,
    rank_slice,
    slice_sizes,
    split_by_rank,
)

EVERY = " (raised on every rank before any data moved)"


def caught(fn):
    """``("ok", value)`` or ``(exception type name, message)``: run on every rank, compared across ranks."""
    try:
        return "ok", fn()
    except Exception as exc:  # the tests assert the type
        return type(exc).__name__, str(exc)


def alike(outcomes):
    """The one outcome every rank had (fails naming them when the ranks differ)."""
    assert all(o == outcomes[0] for o in outcomes), f"the ranks answered differently: {outcomes}"
    return outcomes[0]


# ---- all_to_all ---------------------------------------------------------------------------------------------
SPLITS = {2: [[1, 2], [3, 0]],                   # SPLITS[W][src][dst]: rows src sends to dst
          3: [[1, 0, 2], [2, 1, 0], [0, 0, 0]]}  # rank 2 sends nothing (0 rows in); rank 1 receives from itself only


def _rows(src, splits, dtype=torch.float64):
    """Rank ``src``'s input: for each destination its rows ``[v, -v]``, ``v = 100 * src + 10 * dst + j``."""
    vals = [100 * src + 10 * dst + j for dst, n in enumerate(splits[src]) for j in range(n)]
    return torch.tensor([[v, -v] for v in vals], dtype=dtype).reshape(-1, 2)


def _received(dst, splits):
    """What rank ``dst`` must hold after the exchange: every source's rows for it, in source order."""
    vals = [100 * src + 10 * dst + j for src in range(len(splits)) for j in range(splits[src][dst])]
    return [[float(v), float(-v)] for v in vals]


def _coef(dst, n):
    """Rank ``dst``'s loss weights: loss = (out * coef).sum(), so d loss / d out = coef."""
    return torch.tensor([[1000.0 * dst + 2 * p, 0.5 + dst] for p in range(n)], dtype=torch.float64).reshape(-1, 2)


def _a2a(splits, check):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _rows(rank, splits).requires_grad_()
    out = all_to_all(x, [splits[s][rank] for s in range(world)], splits[rank], check=check)
    (out * _coef(rank, out.shape[0])).sum().backward()
    return out.tolist(), x.grad.tolist()


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_moves_each_block_to_its_rank_and_back_in_backward(world, check):
    splits = SPLITS[world]
    got = run_ranks(_a2a, world, splits, check)
    for dst in range(world):
        assert got[dst][0] == _received(dst, splits), dst
    # backward: a row's gradient is the loss weight at the place it landed on its destination
    for src in range(world):
        want = []
        for dst in range(world):
            before = sum(splits[s][dst] for s in range(src))           # rows of lower sources land first
            want += [_coef(dst, before + splits[src][dst])[before + j].tolist() for j in range(splits[src][dst])]
        assert got[src][1] == want, src


def test_all_to_all_by_hand_two_ranks():
    got = run_ranks(_a2a, 2, SPLITS[2], True)
    assert got[0][0] == [[0.0, -0.0], [100.0, -100.0], [101.0, -101.0], [102.0, -102.0]]
    assert got[1][0] == [[10.0, -10.0], [11.0, -11.0]]
    # rank 0's rows: 0 stays (weight row 0 of rank 0), 10 and 11 land as rows 0 and 1 of rank 1
    assert got[0][1] == [[0.0, 0.5], [1000.0, 1.5], [1002.0, 1.5]]
    assert got[1][1] == [[2.0, 0.5], [4.0, 0.5], [6.0, 0.5]]          # rows 1..3 of rank 0


def _a2a_sub():
    sub = dist.new_group([0, 2])
    if dist.get_rank() == 1:
        return None                                                   # not in the group: takes no part
    me = dist.get_rank(sub)                                           # 0 or 1 within the group
    splits = [[1, 2], [0, 1]]
    x = _rows(me, splits).requires_grad_()
    out = all_to_all(x, [splits[s][me] for s in range(2)], splits[me], sub)
    (out * _coef(me, out.shape[0])).sum().backward()
    return out[:, 0].tolist(), x.grad[:, 0].tolist()


def test_all_to_all_over_a_subgroup():
    got = run_ranks(_a2a_sub, 3)
    assert got[1] is None
    assert got[0] == ([0.0], [0.0, 1000.0, 1002.0])                  # keeps 0; 10, 11 go to group rank 1
    assert got[2] == ([10.0, 11.0, 110.0], [1004.0])                 # 110: group rank 1's row for itself


def _a2a_errors():
    rank = dist.get_rank()
    x = torch.ones(3, 2)
    o, i = ([1, 2], [1, 2]) if rank == 0 else ([2, 1], [2, 1])         # agreeing splits: o[r][s] == i[s][r]
    out = {}
    out["entries"] = caught(lambda: all_to_all(x, o, [3] if rank == 1 else i))
    out["0-d"] = caught(lambda: all_to_all(torch.tensor(1.0) if rank == 0 else x, o, i))
    out["sum"] = caught(lambda: all_to_all(x, o, [1, 1] if rank == 1 else i))
    out["negative"] = caught(lambda: all_to_all(x, o, [-1, 4] if rank == 0 else i))
    out["ndim"] = caught(lambda: all_to_all(torch.ones([1] * 17) if rank == 1 else x[:1], [1, 0], [1, 0]))
    out["dtype"] = caught(lambda: all_to_all(x.double() if rank == 1 else x, o, i))
    out["trailing"] = caught(lambda: all_to_all(torch.ones(3, 4) if rank == 1 else x, o, i))
    out["rows"] = caught(lambda: all_to_all(x, [1, 2] if rank == 1 else o, i))
    out["good after"] = caught(lambda: all_to_all(x, o, i)[:, 0].tolist())
    return out


def test_all_to_all_mismatches_raise_the_same_error_on_every_rank():
    ranks = run_ranks(_a2a_errors, 2)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    mismatch = CollectiveMismatch.__name__
    assert got["entries"] == (mismatch, "all_to_all: rank 1 split sizes need one entry per rank (world size 2); got "
                                        "1 input and 2 output entries" + EVERY)
    assert got["0-d"] == (mismatch, "all_to_all: rank 0 x is a 0-d tensor; all_to_all cuts rows along dim 0" + EVERY)
    assert got["sum"] == (mismatch, "all_to_all: rank 1 input_split_sizes sum to 2 but x has 3 rows" + EVERY)
    assert got["negative"] == (mismatch, "all_to_all: rank 0 split sizes must be >= 0, got input [-1, 4] and output "
                                         "[1, 2]" + EVERY)
    assert got["ndim"] == (mismatch, "all_to_all: rank 1 x has ndim=17 (the checked all_to_all takes at most 16; "
                                     "pass check=False)" + EVERY)
    assert got["dtype"] == (mismatch, "all_to_all: ranks disagree on dtype: rank 0 torch.float32, rank 1 "
                                      "torch.float64" + EVERY)
    assert got["trailing"] == (mismatch, "all_to_all: ranks disagree on the dims after dim 0: rank 0 [2], rank 1 [4]"
                                         + EVERY)
    # rank 0 sends [1, 2] and expects [1, 2]; rank 1 sends [2, 1] but expects [1, 2]
    assert got["rows"] == (mismatch, "all_to_all: rank 1 expects 1 rows from rank 0 (output_split_sizes[0]) but rank "
                                     "0 sends it 2 (input_split_sizes[1]); rank 1 expects 2 rows from rank 1 "
                                     "(output_split_sizes[1]) but rank 1 sends it 1 (input_split_sizes[1])" + EVERY)
    assert got["good after"] == ("ok", [1.0, 1.0, 1.0])


def _a2a_rows_mismatch():
    rank = dist.get_rank()
    x = torch.arange(3.0).view(3, 1)
    return caught(lambda: all_to_all(x, [1, 2] if rank == 0 else [2, 2], [1, 2] if rank == 0 else [2, 1]))


def test_all_to_all_names_every_pair_of_ranks_that_disagree_on_rows():
    # rank 0: sends [1, 2], expects [1, 2]; rank 1: sends [2, 1], expects [2, 2]
    # 0<-0: 1 vs 1 ok; 0<-1: expects 2, rank 1 sends 2 ok; 1<-0: expects 2, rank 0 sends 2 ok; 1<-1: expects 2, sends 1
    kind, text = alike(run_ranks(_a2a_rows_mismatch, 2))
    assert (kind, text) == ("CollectiveMismatch", "all_to_all: rank 1 expects 2 rows from rank 1 (output_split_sizes"
                                                  "[1]) but rank 1 sends it 1 (input_split_sizes[1])" + EVERY)


def _a2a_unchecked_errors():
    x = torch.ones(3, 2)
    return [caught(lambda: all_to_all(x, [1, 2], [3], check=False)),
            caught(lambda: all_to_all(torch.tensor(2.0), [1, 0], [1, 0], check=False)),
            caught(lambda: all_to_all(x, [1, 2], [1, 1], check=False)),
            caught(lambda: all_to_all(x, [1, 2], [4, -1], check=False)),
            caught(lambda: all_to_all(torch.ones([1] * 17), *([[1, 0]] * 2 if dist.get_rank() == 0 else [[0, 1]] * 2),
                                      check=False).shape)]


def test_all_to_all_without_the_check_still_refuses_this_ranks_own_bad_input_locally():
    got = alike(run_ranks(_a2a_unchecked_errors, 2))
    assert got[:4] == [
        ("ValueError", "all_to_all: split sizes need one entry per rank (world size 2); got 1 input and 2 output "
                       "entries"),
        ("ValueError", "all_to_all: x is a 0-d tensor; all_to_all cuts rows along dim 0"),
        ("ValueError", "all_to_all: input_split_sizes sum to 2 but x has 3 rows"),
        ("ValueError", "all_to_all: split sizes must be >= 0, got input [4, -1] and output [1, 2]")]
    assert got[4] == ("ok", torch.Size([1] * 17))                    # check=False takes more than 16 dims




# ---- all-gathers --------------------------------------------------------------------------------------------
def _same_dim(check):
    rank = dist.get_rank()
    t = torch.tensor([[rank, 10 * rank], [rank + 1, 7]])
    return [p.tolist() for p in all_gather_same_dim(t, check=check)]


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_same_dim_lists_every_ranks_tensor(world, check):
    want = [[[r, 10 * r], [r + 1, 7]] for r in range(world)]
    assert run_ranks(_same_dim, world, check) == [want] * world


def _same_dim_errors():
    rank = dist.get_rank()
    return {"shape": caught(lambda: all_gather_same_dim(torch.ones(2, 3 + rank))),
            "ndim": caught(lambda: all_gather_same_dim(torch.ones(2, 3) if rank == 0 else torch.ones(2, 3, 1))),
            "dtype": caught(lambda: all_gather_same_dim(torch.ones(2, dtype=torch.int64 if rank else torch.float32))),
            "both": caught(lambda: all_gather_same_dim(torch.ones(1 + rank, dtype=torch.int8 if rank else
                                                                 torch.float16))),
            "ndim 17": caught(lambda: all_gather_same_dim(torch.ones([1] * (16 + rank)))),
            "scalar": caught(lambda: [t.item() for t in all_gather_same_dim(torch.tensor(float(rank)))])}


def test_all_gather_same_dim_mismatches_raise_on_every_rank():
    ranks = run_ranks(_same_dim_errors, 2)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    pre = "all_gather_same_dim: "
    assert got["shape"] == ("CollectiveMismatch", pre + "ranks disagree on shape: rank 0 [2, 3] (ndim 2), rank 1 [2, "
                                                        "4] (ndim 2)" + EVERY)
    assert got["ndim"] == ("CollectiveMismatch", pre + "ranks disagree on shape: rank 0 [2, 3] (ndim 2), rank 1 [2, "
                                                       "3, 1] (ndim 3)" + EVERY)
    assert got["dtype"] == ("CollectiveMismatch", pre + "ranks disagree on dtype: rank 0 torch.float32, rank 1 "
                                                        "torch.int64 (every rank must pass the same dtype)" + EVERY)
    assert got["both"] == ("CollectiveMismatch", pre + "ranks disagree on dtype: rank 0 torch.float16, rank 1 "
                                                       "torch.int8 (every rank must pass the same dtype); ranks "
                                                       "disagree on shape: rank 0 [1] (ndim 1), rank 1 [2] (ndim 1)"
                           + EVERY)
    assert got["ndim 17"] == ("CollectiveMismatch", pre + "rank 1 passed a tensor with ndim=17 (the checked "
                                                          "collectives take at most 16; pass check=False)" + EVERY)
    assert got["scalar"] == ("ok", [0.0, 1.0])                         # a 0-d tensor is fine without a dim


def _sizes(dim):
    rank = dist.get_rank()
    t = torch.zeros(2, 1 + 2 * rank, 5)
    return gather_sizes(t, dim).tolist() if dim is not None else gather_sizes(t.transpose(0, 1)).tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_gather_sizes(world):
    assert run_ranks(_sizes, world, 1) == [[1 + 2 * r for r in range(world)]] * world
    assert run_ranks(_sizes, world, -2) == [[1 + 2 * r for r in range(world)]] * world
    assert run_ranks(_sizes, world, 0) == [[2] * world] * world
    assert run_ranks(_sizes, world, None) == [[1 + 2 * r for r in range(world)]] * world     # dim 0 by default


def _sizes_errors():
    return [caught(lambda: gather_sizes(torch.tensor(3.0))), caught(lambda: gather_sizes(torch.ones(2), dim=1)),
            caught(lambda: gather_sizes(torch.ones(2), dim=-2))]


def test_gather_sizes_refuses_a_scalar_and_a_dim_out_of_range():
    assert alike(run_ranks(_sizes_errors, 2)) == [
        ("ValueError", "gather_sizes: this rank passed a 0-d tensor (a scalar); gather t.reshape(1) instead"),
        ("IndexError", "gather_sizes: this rank passed dim=1, out of range for a tensor with ndim=1 (expected -1..0)"),
        ("IndexError", "gather_sizes: this rank passed dim=-2, out of range for a tensor with ndim=1 (expected "
                       "-1..0)")]


ROWS = {2: [2, 0], 3: [2, 0, 3]}   # rows per rank along the gathered dim: unequal on purpose, one rank with none


def _block(rank, n, dim):
    """Rank ``rank``'s ``n`` entries along ``dim`` of a (n, 2) (dim 0) or (2, n) (dim 1) tensor: ``100 * rank + j``."""
    t = torch.tensor([[100.0 * rank + j, -(100.0 * rank + j)] for j in range(n)]).reshape(n, 2)
    return t if dim in (0, -2) else t.t().contiguous()


def _variable(rows, dim, check, given):
    rank = dist.get_rank()
    t = _block(rank, rows[rank], dim)
    sizes = {"none": None, "list": list(rows), "tensor": torch.tensor(rows)}[given]
    gathered, s = all_gather_variable_dim(t, dim=dim, sizes=sizes, check=check)
    return gathered.tolist(), s.tolist(), s.dtype


@pytest.mark.parametrize("given", ["none", "list", "tensor"])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_variable_dim_concatenates_unequal_ranks(world, dim, check, given):
    rows = ROWS[world]
    want = torch.cat([_block(r, n, dim) for r, n in enumerate(rows)], dim=dim).tolist()
    assert run_ranks(_variable, world, rows, dim, check, given) == [(want, rows, torch.int64)] * world


def test_all_gather_variable_dim_by_hand():
    got = run_ranks(_variable, 3, [2, 0, 1], 0, True, "none")[1]
    assert got == ([[0.0, -0.0], [1.0, -1.0], [200.0, -200.0]], [2, 0, 1], torch.int64)
    got = run_ranks(_variable, 2, [1, 2], 1, False, "none")[0]
    assert got == ([[0.0, 100.0, 101.0], [-0.0, -100.0, -101.0]], [1, 2], torch.int64)


def _equal_sizes(check):
    t = torch.full((2, 1), float(dist.get_rank()))
    gathered, s = all_gather_variable_dim(t, check=check)
    return gathered.view(-1).tolist(), s.tolist()


@pytest.mark.parametrize("check", [True, False])
def test_all_gather_variable_dim_of_equal_sizes(check):
    assert run_ranks(_equal_sizes, 3, check) == [([0.0, 0.0, 1.0, 1.0, 2.0, 2.0], [2, 2, 2])] * 3


def _variable_errors():
    rank = dist.get_rank()
    t = torch.ones(2, 3)
    f = all_gather_variable_dim
    return {
        "wrong sizes": caught(lambda: f(t, sizes=[5, 5])),
        "wrong sizes on one rank": caught(lambda: f(t, sizes=[2, 3] if rank else None)),
        "sizes entries": caught(lambda: f(t, sizes=[2, 2, 2] if rank == 0 else None)),
        "dim": caught(lambda: f(t, dim=2)),
        "dim on one rank": caught(lambda: f(t, dim=-3 if rank else 0)),
        "dim and scalar": caught(lambda: f(t if rank else torch.tensor(1.0), dim=2)),
        "other dims": caught(lambda: f(torch.ones(2, 3 + rank))),
        "other dims along 1": caught(lambda: f(torch.ones(2 + rank, 3), dim=1)),
        "dtype": caught(lambda: f(t.to(torch.float64 if rank else torch.float32))),
        "unchecked scalar": caught(lambda: f(torch.tensor(1.0), check=False)),
        "unchecked dim": caught(lambda: f(t, dim=-3, check=False)),
        "unchecked sizes entries": caught(lambda: f(t, sizes=[2, 2, 2], check=False)),
        "unchecked ndim 17": caught(lambda: f(torch.ones([1] * 17), check=False)[1].tolist()),
        "good after": caught(lambda: f(t[:1 + rank])[1].tolist()),
    }


def test_all_gather_variable_dim_mismatches_raise_on_every_rank():
    ranks = run_ranks(_variable_errors, 2)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    pre = "all_gather_variable_dim: "
    mm = "CollectiveMismatch"
    assert got["wrong sizes"] == (mm, pre + "rank 0 passed sizes=[5, 5] but the ranks hold [2, 2] along dim 0; rank "
                                            "1 passed sizes=[5, 5] but the ranks hold [2, 2] along dim 0" + EVERY)
    assert got["wrong sizes on one rank"] == (mm, pre + "rank 1 passed sizes=[2, 3] but the ranks hold [2, 2] along "
                                                        "dim 0" + EVERY)
    assert got["sizes entries"] == (mm, pre + "rank 0 passed sizes= with 3 entries for 2 ranks" + EVERY)
    assert got["dim"] == ("IndexError", pre + "rank 0 passed dim=2, out of range for a tensor with ndim=2 (expected "
                                              "-2..1); rank 1 passed dim=2, out of range for a tensor with ndim=2 "
                                              "(expected -2..1)" + EVERY)
    assert got["dim on one rank"] == ("IndexError", pre + "rank 1 passed dim=-3, out of range for a tensor with "
                                                          "ndim=2 (expected -2..1)" + EVERY)
    assert got["dim and scalar"] == (mm, pre + "rank 0 passed a 0-d tensor (a scalar); gather t.reshape(1) instead; "
                                               "rank 1 passed dim=2, out of range for a tensor with ndim=2 (expected "
                                               "-2..1)" + EVERY)
    assert got["other dims"] == (mm, pre + "ranks disagree on the dims other than dim 0: rank 0 [3] (ndim 2), rank 1 "
                                           "[4] (ndim 2)" + EVERY)
    assert got["other dims along 1"] == (mm, pre + "ranks disagree on the dims other than dim 1: rank 0 [2] (ndim 2), "
                                                   "rank 1 [3] (ndim 2)" + EVERY)
    assert got["dtype"] == (mm, pre + "ranks disagree on dtype: rank 0 torch.float32, rank 1 torch.float64 (every "
                                      "rank must pass the same dtype)" + EVERY)
    assert got["unchecked scalar"] == ("ValueError", pre + "this rank passed a 0-d tensor (a scalar); gather "
                                                           "t.reshape(1) instead")
    assert got["unchecked dim"] == ("IndexError", pre + "this rank passed dim=-3, out of range for a tensor with "
                                                        "ndim=2 (expected -2..1)")
    assert got["unchecked sizes entries"] == ("ValueError", "sizes has 3 entries for 2 ranks")
    assert got["unchecked ndim 17"] == ("ok", [1, 1])                # check=False takes more than 16 dims
    assert got["good after"] == ("ok", [1, 2])


def _unchecked_wrong_sizes():
    return caught(lambda: all_gather_variable_dim(torch.ones(2, 3), sizes=[5, 2] if dist.get_rank() == 0 else
                                                  [2, 5], check=False))


def test_all_gather_variable_dim_unchecked_sizes_that_do_not_fit_this_rank():
    assert run_ranks(_unchecked_wrong_sizes, 2) == [
        ("ValueError", "sizes says this rank holds 5 entries along dim 0 but t has 2")] * 2


# ---- the differentiable all_gather -------------------------------------------------------------------------
def _weights(rank, shape):
    """Rank ``rank``'s loss weights over the gathered tensor: loss_r = (gathered * weights).sum()."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).view(shape) + 1) * (rank + 1) ** 2


def _gather_grad(rows, dim, grad, module, check):
    rank = dist.get_rank()
    x = _block(rank, rows[rank], dim).double().requires_grad_()
    if module:
        gathered, sizes = AllGather(dim=dim, grad=grad, check=check)(x)
    else:
        gathered, sizes = all_gather(x, dim, None, grad, check=check)
    (gathered * _weights(rank, gathered.shape)).sum().backward()
    return gathered.tolist(), sizes.tolist(), sizes.requires_grad, x.grad.tolist()


@pytest.mark.parametrize("module", [False, True])
@pytest.mark.parametrize("grad", ["slice", "sum"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_gradient_is_own_slice_or_sum_over_ranks(world, dim, grad, module):
    rows = ROWS[world]
    full = torch.cat([_block(r, n, dim) for r, n in enumerate(rows)], dim=dim)
    got = run_ranks(_gather_grad, world, rows, dim, grad, module, True)
    starts = [sum(rows[:r]) for r in range(world)]
    for rank in range(world):
        gathered, sizes, sizes_grad, x_grad = got[rank]
        assert gathered == full.tolist() and sizes == rows and not sizes_grad
        mine = [_weights(q, full.shape).narrow(dim, starts[rank], rows[rank]) for q in range(world)]
        want = mine[rank] if grad == "slice" else sum(mine)
        assert x_grad == want.tolist(), (rank, x_grad, want)


def test_all_gather_gradient_by_hand():
    # ranks hold 1 and 2 rows; weights: rank 0 [1, 2, 3, 4, 5, 6] x 1, rank 1 the same x 4 (gathered (3, 2))
    got = run_ranks(_gather_grad, 2, [1, 2], 0, "sum", False, False)
    assert got[0][3] == [[1.0 + 4.0, 2.0 + 8.0]]
    assert got[1][3] == [[3.0 + 12.0, 4.0 + 16.0], [5.0 + 20.0, 6.0 + 24.0]]
    got = run_ranks(_gather_grad, 2, [1, 2], 0, "slice", True, False)
    assert got[0][3] == [[1.0, 2.0]] and got[1][3] == [[12.0, 16.0], [20.0, 24.0]]


def _gather_sizes_given():
    rank = dist.get_rank()
    sizes = torch.tensor([1, 2])
    x = torch.full((1 + rank, 1), rank + 1.0, requires_grad=True)
    gathered, out_sizes = all_gather(x, sizes=sizes, grad="sum")
    (gathered * (rank + 1)).sum().backward()
    module_out = AllGather(grad="sum")(x.detach(), sizes=sizes)[0]
    return gathered.view(-1).tolist(), out_sizes is sizes, out_sizes.tolist(), x.grad.view(-1).tolist(), \
        module_out.view(-1).tolist()


def test_all_gather_with_sizes_given_never_hands_the_input_back():
    got = run_ranks(_gather_sizes_given, 2)
    for rank, (gathered, same_object, sizes, grad, module_out) in enumerate(got):
        assert gathered == module_out == [1.0, 2.0, 2.0] and sizes == [1, 2] and same_object is False
        assert grad == [3.0] * (1 + rank)                             # d/dx of (1 + 2) * sum


def _grad_mode_errors():
    x = torch.ones(2, 1)
    return [caught(lambda: all_gather(x, grad="mean")), caught(lambda: AllGather(grad="avg"))]


def test_all_gather_refuses_an_unknown_gradient_mode():
    assert run_ranks(_grad_mode_errors, 2) == [[("ValueError", "grad must be 'slice' or 'sum', not 'mean'"),
                                                ("ValueError", "grad must be 'slice' or 'sum', not 'avg'")]] * 2
    with pytest.raises(ValueError, match="grad must be 'slice' or 'sum', not 'avg'"):
        AllGather(grad="avg")


def test_all_gather_module_keeps_its_settings():
    m = AllGather(dim=1, grad="sum", check=False)
    assert (m.dim, m.grad, m.check) == (1, "sum", False)
    assert (AllGather().dim, AllGather().grad, AllGather().check) == (0, "slice", True)


def _function_direct():
    rank = dist.get_rank()
    x = torch.full((1, 1 + rank), float(rank), requires_grad=True)
    gathered, sizes = AllGatherFunction.apply(x, -1, None, "slice", None)  # check defaults to True
    gathered.sum().backward()
    return gathered.tolist(), sizes.tolist(), x.grad.tolist()


def test_all_gather_function_with_a_negative_dim():
    assert run_ranks(_function_direct, 2) == [([[0.0, 1.0, 1.0]], [1, 2], [[1.0]]),
                                              ([[0.0, 1.0, 1.0]], [1, 2], [[1.0, 1.0]])]


def _gathers_over_a_subgroup():
    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return None
    me = dist.get_rank(sub)
    x = torch.full((1 + me, 2), 10.0 * rank, requires_grad=True)
    same = [t.tolist() for t in all_gather_same_dim(torch.tensor([rank]), sub)]
    sizes = gather_sizes(x, 0, sub).tolist()
    var, _ = all_gather_variable_dim(x.detach(), sizes=[1, 2], group=sub)
    var_unchecked, _ = all_gather_variable_dim(x.detach(), group=sub, check=False)
    gathered, _ = all_gather(x, grad="sum", group=sub)
    (gathered * (me + 1)).sum().backward()
    return same, sizes, var[:, 0].tolist(), var_unchecked[:, 0].tolist(), x.grad[:, 0].tolist()


def test_gathers_over_a_subgroup():
    got = run_ranks(_gathers_over_a_subgroup, 3)
    assert got[1] is None
    for me, rank in enumerate((0, 2)):
        assert got[rank][:4] == ([[0], [2]], [1, 2], [0.0, 20.0, 20.0], [0.0, 20.0, 20.0])
        assert got[rank][4] == [3.0] * (1 + me)                      # weights 1 and 2, summed


# ---- slicing a replicated batch -------------------------------------------------------------------------------
def test_slice_sizes_and_rank_slice():
    assert slice_sizes(7, 3) == [3, 2, 2]
    assert slice_sizes(2, 3) == [1, 1, 0]
    assert slice_sizes(6, 2) == [3, 3]
    assert slice_sizes(0, 2) == [0, 0]
    t = torch.arange(7)
    assert [rank_slice(t, r, 3).tolist() for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [rank_slice(t[:2], r, 3).tolist() for r in range(3)] == [[0], [1], []]


def _slice(rows, subgroup):
    rank = dist.get_rank()
    group, me, size = None, rank, dist.get_world_size()
    if subgroup:
        group = dist.new_group([0, 2])
        if rank == 1:
            return None
        me, size = dist.get_rank(group), 2
    inp = torch.arange(rows * 2, dtype=torch.float64).view(rows, 2).requires_grad_()
    out = Slice.apply(inp, me, size, group)
    (out * (me + 1)).sum().backward()
    return out[:, 0].tolist(), inp.grad[:, 0].tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_slice_takes_this_ranks_rows_and_gathers_the_whole_gradient(world):
    got = run_ranks(_slice, world, 7, False)
    sizes = [4, 3] if world == 2 else [3, 2, 2]
    starts = [sum(sizes[:r]) for r in range(world)]
    whole = [float(q + 1) for q in range(world) for _ in range(sizes[q])]   # each rank's weight on its own rows
    for r in range(world):
        assert got[r] == ([2.0 * i for i in range(starts[r], starts[r] + sizes[r])], whole)


def test_slice_over_a_subgroup_with_a_rank_holding_no_row():
    got = run_ranks(_slice, 3, 1, True)
    assert got == [([0.0], [1.0]), None, ([], [1.0])]


def _split(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "tuple":
        x = tuple(torch.full((n, 2), float(r)) for r, n in enumerate([1, 3, 0][:world]))
    elif kind == "list":
        x = [torch.full((n, 2), float(r)) for r, n in enumerate([2, 0, 1][:world])]
    else:
        x = torch.arange(world * 3, dtype=torch.float64).view(world, 3, 1)  # (rank, 3 rows each, 1)
    mine, sizes = split_by_rank(x)
    return mine.tolist(), sizes.tolist(), sizes.dtype, rank


def test_split_by_rank():
    got = run_ranks(_split, 3, "tuple")
    assert [g[1] for g in got] == [[1, 3, 0]] * 3 and got[1][0] == [[1.0, 1.0]] * 3 and got[2][0] == []
    assert got[0][2] == torch.int64
    got = run_ranks(_split, 2, "list")
    assert [g[1] for g in got] == [[2, 0]] * 2 and got[0][0] == [[0.0, 0.0]] * 2
    got = run_ranks(_split, 2, "tensor")
    assert got[1][:2] == ([[3.0], [4.0], [5.0]], [3, 3])


def _split_wrong_length():
    return caught(lambda: split_by_rank([torch.ones(1)] * 3))


def test_split_by_rank_needs_one_entry_per_rank():
    want = ("ValueError", "split_by_rank needs one entry per rank (2), got 3")
    assert run_ranks(_split_wrong_length, 2) == [want] * 2


def test_pad_dim_to():
    t = torch.ones(2, 3)
    assert pad_dim_to(t, 4, dim=1).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert pad_dim_to(t, 3).tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert pad_dim_to(t, 2, dim=0) is t
    assert pad_dim_to(t.long(), 3).dtype == torch.int64
    with pytest.raises(ValueError, match=r"^cannot pad dim 0 of size 2 down to 1$"):
        pad_dim_to(t, 1, dim=0)


# ---- how many collectives: the costs the docstrings state ---------------------------------------------------------
def _count(monkeypatch):
    calls = []
    for name in ("all_gather", "all_to_all_single", "all_reduce", "all_gather_object"):
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            if dist.get_rank() == 0:
                calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(dist, name, wrapper)
    return calls


def _calls_of(case):
    rank = dist.get_rank()
    t = torch.ones(1 + rank, 2)
    if case == "gather_sizes":
        gather_sizes(t)
    elif case == "variable, checked":
        all_gather_variable_dim(t)
    elif case == "variable, checked, sizes given":
        all_gather_variable_dim(t, sizes=[1, 2])
    elif case == "variable, unchecked":
        all_gather_variable_dim(t, check=False)
    elif case == "variable, unchecked, sizes given":
        all_gather_variable_dim(t, sizes=[1, 2], check=False)
    elif case == "same dim, checked":
        all_gather_same_dim(torch.ones(2))
    elif case == "same dim, unchecked":
        all_gather_same_dim(torch.ones(2), check=False)
    elif case == "all_to_all, checked":
        all_to_all(torch.ones(2, 1), [1, 1], [1, 1])
    elif case == "all_to_all, unchecked":
        all_to_all(torch.ones(2, 1), [1, 1], [1, 1], check=False)
    elif case == "slice backward":
        Slice.apply(torch.ones(3, 1, requires_grad=True), rank, 2, None).sum().backward()


@pytest.mark.parametrize("case, want", [
    ("gather_sizes", ["all_gather"]),                                   # one gather of one int each
    ("variable, checked", ["all_gather", "all_gather"]),                # the check (sizes in it), the data
    ("variable, checked, sizes given", ["all_gather", "all_gather"]),
    ("variable, unchecked", ["all_gather", "all_gather"]),              # the sizes, the data
    ("variable, unchecked, sizes given", ["all_gather"]),               # the data only
    ("same dim, checked", ["all_gather", "all_gather"]),
    ("same dim, unchecked", ["all_gather"]),
    ("all_to_all, checked", ["all_gather", "all_to_all_single"]),
    ("all_to_all, unchecked", ["all_to_all_single"]),
    ("slice backward", ["all_gather", "all_gather"]),                   # checked gather of the slices' gradients
])
def test_collectives_cost_what_their_docstrings_say(monkeypatch, case, want):
    calls = _count(monkeypatch)
    run_ranks(_calls_of, 2, case)
    assert calls == want


def _count_calls_more(case):
    rank = dist.get_rank()
    t = torch.ones(1 + rank, 2, requires_grad=True)
    if case == "all_gather unchecked, sizes given":
        all_gather(t, sizes=[1, 2], check=False)
    elif case == "AllGather unchecked, sizes given":
        AllGather(check=False)(t, sizes=[1, 2])
    elif case == "all_gather unchecked":
        all_gather(t, check=False)


@pytest.mark.parametrize("case, want", [
    ("all_gather unchecked, sizes given", ["all_gather"]),
    ("AllGather unchecked, sizes given", ["all_gather"]),
    ("all_gather unchecked", ["all_gather", "all_gather"]),
])
def test_the_differentiable_gather_passes_its_settings_on(monkeypatch, case, want):
    calls = _count(monkeypatch)
    run_ranks(_count_calls_more, 2, case)
    assert calls == want


# ---- the settings reach the collective: defaults, sizes=, check=, group= ------------------------------------------
def _settings():
    rank = dist.get_rank()
    x = torch.ones(1 + rank, 2)
    mixed = x.to(torch.float64 if rank else torch.float32)
    out = {
        "16 dims": caught(lambda: all_to_all(torch.ones([1] * 16), [1, 0] if rank == 0 else [0, 1],
                                             [1, 0] if rank == 0 else [0, 1]).dim()),
        "default grad": caught(lambda: all_gather(x.clone().requires_grad_())[0].shape),
        "default check": caught(lambda: all_gather(mixed)),
        "function default check": caught(lambda: AllGatherFunction.apply(mixed, 0, None, "slice", None)),
        "module default check": caught(lambda: AllGather()(mixed)),
        "wrong sizes": caught(lambda: all_gather(x, sizes=[2, 2])),
        "module wrong sizes": caught(lambda: AllGather()(x, sizes=[2, 2])),
        "int32 sizes": caught(lambda: all_gather_variable_dim(x, sizes=torch.tensor([1, 2], dtype=torch.int32))[1]
                              .dtype),
        "int32 sizes unchecked": caught(lambda: all_gather_variable_dim(x, sizes=torch.tensor([1, 2],
                                                                                        dtype=torch.int32),
                                                                        check=False)[1].dtype),
    }
    return out


def test_settings_reach_the_collective():
    ranks = run_ranks(_settings, 2)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    assert got["16 dims"] == ("ok", 16)                                # 16 dims are checked, not refused
    assert got["default grad"] == ("ok", torch.Size([3, 2]))
    dtype = ("CollectiveMismatch", "all_gather_variable_dim: ranks disagree on dtype: rank 0 torch.float32, rank 1 "
                                   "torch.float64 (every rank must pass the same dtype)" + EVERY)
    assert got["default check"] == got["function default check"] == got["module default check"] == dtype
    sizes = ("CollectiveMismatch", "all_gather_variable_dim: rank 0 passed sizes=[2, 2] but the ranks hold [1, 2] "
                                   "along dim 0; rank 1 passed sizes=[2, 2] but the ranks hold [1, 2] along dim 0"
             + EVERY)
    assert got["wrong sizes"] == got["module wrong sizes"] == sizes
    assert got["int32 sizes"] == got["int32 sizes unchecked"] == ("ok", torch.int64)


def _subgroup_settings():
    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return None
    me = dist.get_rank(sub)
    x = torch.full((1 + me, 2), float(rank))
    eq = torch.full((2, 1 + me), float(rank))[:, :1].contiguous()       # (2, 1) on both: equal sizes
    return {
        "a2a unchecked": caught(lambda: all_to_all(x, [1, 2] if me == 0 else [0, 0], [1, 0] if me == 0 else [2, 0],
                                                   sub, check=False)[:, 0].tolist()),
        "equal sizes": caught(lambda: all_gather_variable_dim(eq, group=sub)[0].view(-1).tolist()),
        "equal sizes unchecked": caught(lambda: all_gather_variable_dim(eq, group=sub, check=False)[0].view(-1)
                                        .tolist()),
        "sizes entries unchecked": caught(lambda: all_gather_variable_dim(x, sizes=[1, 2, 3], group=sub,
                                                                          check=False)),
        "wrong sizes unchecked": caught(lambda: all_gather_variable_dim(x, sizes=[1 + me + 4, 1 + me + 4],
                                                                        group=sub, check=False)),
    }


def test_settings_reach_the_collective_over_a_subgroup():
    got = run_ranks(_subgroup_settings, 3)
    assert got[1] is None
    assert got[0]["a2a unchecked"] == ("ok", [0.0, 2.0, 2.0]) and got[2]["a2a unchecked"] == ("ok", [])
    for r in (0, 2):
        assert got[r]["equal sizes"] == got[r]["equal sizes unchecked"] == ("ok", [0.0, 0.0, 2.0, 2.0])
        assert got[r]["sizes entries unchecked"] == ("ValueError", "sizes has 3 entries for 2 ranks")
    assert got[0]["wrong sizes unchecked"] == ("ValueError", "sizes says this rank holds 5 entries along dim 0 but t "
                                                             "has 1")
    assert got[2]["wrong sizes unchecked"] == ("ValueError", "sizes says this rank holds 6 entries along dim 0 but t "
                                                             "has 2")


def _equal_sizes_dim_1():
    t = torch.full((2, 1), float(dist.get_rank()))
    return all_gather_variable_dim(t, dim=1)[0].tolist(), all_gather_variable_dim(t, dim=1, check=False)[0].tolist()


def test_equal_sizes_along_dim_1():
    want = [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    assert run_ranks(_equal_sizes_dim_1, 3) == [(want, want)] * 3
