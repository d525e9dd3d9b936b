"""labutils/moe/expert_parallel.py pinned for mutation testing (issue 38): what the threaded tests of
test_threaded_expert_parallel.py leave open. The fingerprint's fields exactly, the check and the exchange over a
subgroup (the group's size and rank, not the world's), exactly COUNT_SLOTS experts per rank (the last that fits the
checked message) and more than that over a subgroup, and float counts in ``local_order``. Ranks are threads of this
process (tests/threaded_ranks.py); expected values are worked out by hand."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks

import labutils.moe.expert_parallel as ep
from labutils.agreement import dtype_code
from labutils.moe.expert_parallel import COUNT_SLOTS, ExpertParallelMismatch, exchange_and_run, local_order

D = 3


@pytest.fixture(autouse=True)
def _no_group_left():
    before = dist.is_initialized()   # a group an earlier test left is not this test's
    yield
    assert before or dist.is_initialized() is False, "this test left a process group initialised"


class Scaler:
    """Local expert e on group rank r multiplies its rows by ``r * num_expert + e + 1`` (its global id + 1)."""

    def __init__(self, num_expert, group=None, lid=0):
        self.num_expert, self.moe_group, self.layer_id = num_expert, group, lid

    def run_experts(self, x, counts):
        rank = dist.get_rank(self.moe_group)
        return torch.cat([p * (rank * self.num_expert + e + 1) for e, p in enumerate(x.split(counts.tolist()))])


def test_the_fingerprint_is_every_field_in_order():
    layer = Scaler(2, lid=7)
    x = torch.zeros(4, 2, 5, dtype=torch.float64)                        # d_model is the LAST dimension
    counts = torch.tensor([1, 0, 2, 1, 0, 0])
    assert ep._fingerprint(layer, x, counts, 3) == [0x6D6F65, 3, 2, 5, 7, 0, dtype_code(torch.float64), 1, 6]
    with torch.no_grad():
        assert ep._fingerprint(layer, x, counts[:4], 2) == [0x6D6F65, 2, 2, 5, 7, 1, dtype_code(torch.float64), 0, 4]


def _check_in_a_subgroup(seen):
    sub = dist.new_group([0, 2])
    if dist.get_rank() == 1:
        return None
    ep.check_agreement(Scaler(1, sub), torch.zeros(2, D), torch.tensor([1, 1]), sub)
    return "ok"


def test_check_agreement_sends_the_groups_size(monkeypatch):
    seen, real = [], ep.gather_rows

    def spy(row, like, group, **kw):
        seen.append(list(row))
        return real(row, like, group, **kw)

    monkeypatch.setattr(ep, "gather_rows", spy)
    assert run_ranks(_check_in_a_subgroup, 3, seen) == ["ok", None, "ok"]
    assert [row[1] for row in seen] == [2, 2]                           # 2 ranks in the group, 3 in the world


def _mismatch_in_a_subgroup():
    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return None
    ne = 1 + (rank == 2)
    counts = torch.zeros(2 * ne, dtype=torch.long)
    counts[0] = 2
    try:
        exchange_and_run(Scaler(ne, sub), torch.zeros(2, D), counts)
    except ExpertParallelMismatch as e:
        return str(e)


def test_the_exchanges_check_speaks_as_the_rank_in_the_group():
    got = run_ranks(_mismatch_in_a_subgroup, 3)
    line = "num_expert: rank 0=1, rank 1=2\n  counts length: rank 0=2, rank 1=4"
    assert got == [f"expert-parallel ranks disagree before the all-to-all (rank 0 speaking):\n  {line}", None,
                   f"expert-parallel ranks disagree before the all-to-all (rank 1 speaking):\n  {line}"]


def _one_row_to_each_first_expert(ne, subgroup):
    group, members = None, [0, 1]
    if subgroup:
        group, members = dist.new_group([0, 2]), [0, 2]
        if dist.get_rank() not in members:
            return None
    rank = dist.get_rank(group)
    counts = torch.zeros(2 * ne, dtype=torch.long)
    counts[[0, ne]] = 1
    x = torch.full((2, D), rank + 1.0)
    return exchange_and_run(Scaler(ne, group), x, counts)[:, 0].tolist()


def test_exactly_count_slots_experts_ride_in_the_checked_message(monkeypatch):
    sizes, real = [], dist.all_to_all_single

    def count(out, inp, *a, **kw):
        if dist.get_rank() == 0:
            sizes.append(inp.numel())
        return real(out, inp, *a, **kw)

    monkeypatch.setattr(dist, "all_to_all_single", count)
    ne = COUNT_SLOTS
    # rank r's row for rank s's expert 0 comes back times s * 16 + 1
    assert run_ranks(_one_row_to_each_first_expert, 2, ne, False) == [[1.0, 17.0], [2.0, 34.0]]
    assert sizes == [2 * (9 + COUNT_SLOTS), 2 * D, 2 * D]                 # no second counts exchange


def test_more_experts_than_count_slots_over_a_subgroup():
    ne = COUNT_SLOTS + 1
    assert run_ranks(_one_row_to_each_first_expert, 3, ne, True) == [[1.0, 18.0], None, [2.0, 36.0]]


def test_local_order_takes_counts_of_any_dtype():
    # blocks (src 0: e0 2 rows, e1 1 row), (src 1: e0 1 row, e1 2 rows) -> e0: rows 0,1,3 then e1: rows 2,4,5
    got = local_order(torch.tensor([2.0, 1.0, 1.0, 2.0], dtype=torch.float64), 2)
    assert got.dtype == torch.long and got.tolist() == [0, 1, 3, 2, 4, 5]


def test_the_exchange_without_a_process_group_names_itself(monkeypatch):
    """x_exchange_and_run__mutmut_11..15: the message says what needed the group."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)            # as in a fresh process
    with pytest.raises(RuntimeError, match=r"^expert-parallel exchange needs a process group, but torch\.distributed "
                                           r"is not initialised"):
        exchange_and_run(Scaler(1), torch.zeros(1, D), torch.tensor([1]))


def _public_steps_over_a_subgroup():
    """Group {0, 2} of a 3-rank world, 2 experts each. Group rank g sends row 0 (value g + 1) to global expert 0
    (group rank 0's first) and row 1 (value 10 (g + 1)) to global expert 3 (group rank 1's second)."""
    sub = dist.new_group([0, 2])
    if dist.get_rank() == 1:
        return None
    g = dist.get_rank(sub)
    x = torch.tensor([[g + 1.0] * D, [10.0 * (g + 1)] * D])               # (2, D) sorted by global expert
    local = torch.tensor([1, 0, 0, 1])                                     # (W*E,) rows to each global expert
    glob = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]][g])                   # rows from (src, my expert), by hand
    x_local, perm = ep.to_experts(x, local, glob, group=sub)
    y_local = x_local * (g * 2 + torch.tensor([[0.0], [1.0]])[g] + 1)      # my experts: global id + 1
    back = ep.from_experts(y_local, local, glob, group=sub, perm=perm)
    back_no_perm = ep.from_experts(y_local, local, glob, group=sub)
    unchecked = exchange_and_run(Scaler(2, sub), x, local, check=False)
    return [t[:, 0].tolist() for t in (x_local, back, back_no_perm, unchecked)] + [perm.tolist()]


def test_the_public_steps_and_the_unchecked_exchange_use_the_layers_subgroup():
    """x_to_experts__mutmut_4/20, x_from_experts__mutmut_4/20, x_exchange_and_run__mutmut_39/42: the split sizes,
    both all-to-alls and the bare counts exchange over the group given, not the world (a world of 3 here)."""
    got = run_ranks(_public_steps_over_a_subgroup, 3)
    assert got[1] is None
    # group rank 0 runs expert 0 (x1) on the two first rows; group rank 1 runs its expert 1 (x4) on the two others
    assert got[0] == [[1.0, 2.0], [1.0, 40.0], [1.0, 40.0], [1.0, 40.0], [0, 1]]
    assert got[2] == [[10.0, 20.0], [2.0, 80.0], [2.0, 80.0], [2.0, 80.0], [0, 1]]
