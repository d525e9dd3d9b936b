"""labutils.data_parallel on 2, 3 and 4 in-process ranks (tests/threaded_ranks.py): which group each gradient is
reduced over and by what it is divided, the start-up broadcasts, both wrappers, and the refusals when replicas
disagree. Parameters and gradients are small constants set by hand (rank r's gradient ``3 * (r + 1)`` and so on),
so every expected value below is worked out in the comment next to it. tests/test_data_parallel.py and
test_bad_input_ranks.py run the chapter's models and the same refusals in gloo workers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks
from torch import nn

from labutils.data_parallel import (
    DistributedGroupedDataParallel,
    GroupedDataParallel,
    allreduce_grouped_grads,
    broadcast_grouped_params,
    grad_group,
    is_expert_param,
    mark_expert_params,
    split_dense_expert,
)

EVERY = " (raised on every rank before any data moved)"


def caught(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # the tests assert the type
        return type(exc).__name__, str(exc)


def alike(outcomes):
    assert all(o == outcomes[0] for o in outcomes), f"the ranks answered differently: {outcomes}"
    return outcomes[0]


class Tagged(nn.Module):
    """One parameter per entry of ``tags`` (name -> dp_comm tag, None: untagged), value ``value(name)``."""

    def __init__(self, tags: dict, value=lambda name: 0.0, dtypes=None, shape=(2,)):
        super().__init__()
        for name, tag in tags.items():
            dtype = (dtypes or {}).get(name, torch.float32)
            p = nn.Parameter(torch.full(shape, float(value(name)), dtype=dtype))
            if tag is not None:
                p.dp_comm = tag
            self.register_parameter(name, p)

    def forward(self, x):
        return x * 2

    def set_grads(self, grad: dict):
        for name, p in self.named_parameters():
            if name in grad:
                p.grad = torch.full_like(p, float(grad[name]))

    def grads(self):
        return {n: (p.grad[0].item() if p.grad is not None else None) for n, p in self.named_parameters()}

    def values(self):
        return {n: p[0].item() for n, p in self.named_parameters()}


# ---- tags, without ranks -----------------------------------------------------------------------------------------
def test_tags_and_groups():
    m = Tagged({"d": None, "dp": "dp", "g": "gate", "w": "world", "e": "expert", "n": "none"})
    assert [grad_group(p) for p in m.parameters()] == ["dp", "dp", "world", "world", "expert", "expert"]
    assert [is_expert_param(p) for p in m.parameters()] == [False, False, False, False, True, True]
    ds = nn.Linear(2, 2)
    ds.weight.allreduce = False                                         # DeepSpeed's expert marker
    ds.bias.allreduce = True
    assert [grad_group(p) for p in ds.parameters()] == ["expert", "dp"]
    bad = nn.Parameter(torch.zeros(2, 3))
    bad.dp_comm = "tensor"
    with pytest.raises(ValueError) as info:
        grad_group(bad)
    assert str(info.value) == ("unknown dp_comm 'tensor' on a parameter of shape (2, 3); expected one of ['dp', "
                               "'expert', 'gate', 'none', 'world']")


def test_mark_expert_params_and_split_dense_expert():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert mark_expert_params(m[1]) is m[1]
    assert [getattr(p, "dp_comm", None) for p in m.parameters()] == [None, None, "expert", "expert"]
    m[0].bias.requires_grad_(False)
    dense, expert = split_dense_expert(m)
    assert [n for n, _ in dense] == ["0.weight"] and [n for n, _ in expert] == ["1.weight", "1.bias"]
    assert dense[0][1] is m[0].weight




# ---- allreduce_grouped_grads ------------------------------------------------------------------------------------
TAGS = {"d": None, "g": "gate", "e": "expert"}


def _reduce(expert_scale, layout):
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_group = expert_dp_group = None
    if layout == "dp {0,1} {2}":
        groups = [dist.new_group([0, 1]), dist.new_group([2])]
        dp_group = groups[rank // 2]
    elif layout == "edp {0,2} {1,3}":
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        expert_dp_group = groups[rank % 2]
    elif layout == "edp world":
        expert_dp_group = dist.new_group(list(range(world)))
    m = Tagged(TAGS)
    m.set_grads({"d": 3 * (rank + 1), "g": 3 * (rank + 1), "e": 12 * (rank + 1)})
    counts = allreduce_grouped_grads(m, dp_group=dp_group, expert_dp_group=expert_dp_group, expert_scale=expert_scale)
    return m.grads(), counts


COUNTS = {"dp": 1, "world": 1, "expert": 1}


def test_dense_gradients_are_averaged_and_local_experts_divided_by_the_dp_size():
    # 3 ranks: d and g (3, 6, 9) -> 6; e (12, 24, 36): no expert-data-parallel group, so each keeps its own,
    # divided by 3 ("mean") or not ("sum")
    got = run_ranks(_reduce, 3, "mean", "default")
    assert got == [({"d": 6.0, "g": 6.0, "e": e}, COUNTS) for e in (4.0, 8.0, 12.0)]
    got = run_ranks(_reduce, 3, "sum", "default")
    assert got == [({"d": 6.0, "g": 6.0, "e": e}, COUNTS) for e in (12.0, 24.0, 36.0)]


def test_dense_over_the_data_parallel_group_gate_over_every_rank():
    # dp groups {0, 1} and {2}: d (3, 6) -> 4.5 on ranks 0, 1; 9 alone on rank 2. g over all: 6.
    # e: divided by the size of MY dp group ("mean"): 12 / 2, 24 / 2, 36 / 1
    got = run_ranks(_reduce, 3, "mean", "dp {0,1} {2}")
    assert [g for g, _ in got] == [{"d": 4.5, "g": 6.0, "e": 6.0}, {"d": 4.5, "g": 6.0, "e": 12.0},
                                   {"d": 9.0, "g": 6.0, "e": 36.0}]


def test_experts_summed_over_their_replicas():
    # 4 ranks, expert replicas {0, 2} and {1, 3}: e (12, 24, 36, 48) -> 48 and 72, "mean" divides by 4 (dp size)
    got = run_ranks(_reduce, 4, "mean", "edp {0,2} {1,3}")
    assert [g["e"] for g, _ in got] == [12.0, 18.0, 12.0, 18.0]
    assert [g["d"] for g, _ in got] == [7.5] * 4                         # (3 + 6 + 9 + 12) / 4
    got = run_ranks(_reduce, 4, "sum", "edp {0,2} {1,3}")
    assert [g["e"] for g, _ in got] == [48.0, 72.0, 48.0, 72.0]
    # 2 ranks, every expert on both: e (12, 24) -> 36, / 2
    assert [g["e"] for g, _ in run_ranks(_reduce, 2, "mean", "edp world")] == [18.0, 18.0]
    assert [g["e"] for g, _ in run_ranks(_reduce, 2, "sum", "edp world")] == [36.0, 36.0]


def _reduce_missing_and_frozen():
    rank = dist.get_rank()
    m = Tagged({"d": None, "unused": None, "frozen": None, "e": "expert", "w": "world"})
    m.frozen.requires_grad_(False)
    m.set_grads({"d": rank + 1.0, "e": 2.0 * (rank + 1), "w": 5.0})
    m.frozen.grad = torch.full((2,), 7.0)                               # a stale gradient of a frozen parameter
    return allreduce_grouped_grads(m), m.grads()


def test_only_parameters_with_a_gradient_are_reduced():
    got = run_ranks(_reduce_missing_and_frozen, 2)
    for rank, (counts, grads) in enumerate(got):
        assert counts == {"dp": 1, "world": 1, "expert": 1}
        assert grads == {"d": 1.5, "unused": None, "frozen": 7.0, "e": float(rank + 1), "w": 5.0}


def _count_collectives(monkeypatch):
    calls = []
    for name in ("all_reduce", "broadcast"):
        real = getattr(dist, name)

        def wrapper(tensor, *args, _real=real, _name=name, **kwargs):
            calls.append((dist.get_rank(), _name, str(tensor.dtype), tensor.numel()))
            return _real(tensor, *args, **kwargs)
        monkeypatch.setattr(dist, name, wrapper)
    return calls


def _mixed_dtypes(op):
    rank = dist.get_rank()
    dtypes = {"a": torch.float32, "b": torch.float64, "c": torch.float32, "x": torch.float64}
    m = Tagged({"a": None, "b": None, "c": None, "g": "gate", "x": "expert"}, lambda n: 10 * rank + 1,
               dtypes=dtypes, shape=(3,))
    m.set_grads({n: 2.0 * (rank + 1) for n in "abcgx"})
    if op == "reduce":
        allreduce_grouped_grads(m)
        return m.grads()
    broadcast_grouped_params(m)
    return m.values()


def test_one_flat_buffer_per_group_and_dtype(monkeypatch):
    calls = _count_collectives(monkeypatch)
    got = run_ranks(_mixed_dtypes, 2, "reduce")
    assert got == [{"a": 3.0, "b": 3.0, "c": 3.0, "g": 3.0, "x": 1.0}, {"a": 3.0, "b": 3.0, "c": 3.0, "g": 3.0,
                                                                        "x": 2.0}]
    mine = sorted(c for c in calls if c[0] == 0)
    assert mine == sorted([(0, "all_reduce", "torch.float32", 6), (0, "all_reduce", "torch.float64", 3),   # dp: a+c, b
                           (0, "all_reduce", "torch.float32", 3)])                                      # world: g
    calls.clear()
    got = run_ranks(_mixed_dtypes, 2, "broadcast")
    assert got == [{"a": 1.0, "b": 1.0, "c": 1.0, "g": 1.0, "x": x} for x in (1.0, 11.0)]  # experts stay
    assert sorted(c for c in calls if c[0] == 1) == sorted([(1, "broadcast", "torch.float32", 6),
                                                            (1, "broadcast", "torch.float64", 3),
                                                            (1, "broadcast", "torch.float32", 3)])


# ---- broadcast_grouped_params and GroupedDataParallel ----------------------------------------------------------
def _broadcast(layout, wrapper):
    rank = dist.get_rank()
    dp_group = expert_dp_group = None
    if layout == "dp {0} {1,2}":
        groups = [dist.new_group([0]), dist.new_group([1, 2])]
        dp_group = groups[min(rank, 1)]
    elif layout == "edp {0,2} {1,3}":
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        expert_dp_group = groups[rank % 2]
    m = Tagged(TAGS, lambda name: 10 * rank + {"d": 1, "g": 2, "e": 3}[name])
    if wrapper == "function":
        broadcast_grouped_params(m, dp_group=dp_group, expert_dp_group=expert_dp_group)
    elif wrapper == "GroupedDataParallel":
        GroupedDataParallel(m, dp_group=dp_group, expert_dp_group=expert_dp_group)
    else:
        GroupedDataParallel(m, dp_group=dp_group, expert_dp_group=expert_dp_group, sync_params=False)
    return m.values()


@pytest.mark.parametrize("wrapper", ["function", "GroupedDataParallel"])
def test_broadcast_from_the_first_rank_of_each_group(wrapper):
    # default groups, 3 ranks: dense from rank 0 (1, 2), experts stay each rank's own (3, 13, 23)
    assert run_ranks(_broadcast, 3, "default", wrapper) == [{"d": 1.0, "g": 2.0, "e": 10.0 * r + 3} for r in range(3)]
    # dp groups {0} and {1, 2}: rank 2 takes rank 1's d (11); g comes from rank 0 for everyone
    assert run_ranks(_broadcast, 3, "dp {0} {1,2}", wrapper) == [
        {"d": 1.0, "g": 2.0, "e": 3.0}, {"d": 11.0, "g": 2.0, "e": 13.0}, {"d": 11.0, "g": 2.0, "e": 23.0}]
    # expert replicas {0, 2} and {1, 3}: rank 2 takes rank 0's expert, rank 3 rank 1's
    assert [v["e"] for v in run_ranks(_broadcast, 4, "edp {0,2} {1,3}", wrapper)] == [3.0, 13.0, 3.0, 13.0]


def test_grouped_data_parallel_without_sync_leaves_the_replicas_as_they_are():
    assert run_ranks(_broadcast, 2, "default", "no sync") == [{"d": 10.0 * r + 1, "g": 10.0 * r + 2,
                                                                "e": 10.0 * r + 3} for r in range(2)]


def _gdp(expert_scale):
    rank = dist.get_rank()
    m = Tagged(TAGS, lambda name: rank)
    gdp = GroupedDataParallel(m, expert_scale=expert_scale)
    out = gdp(torch.tensor([1.5]))                                       # forward: the module's
    m.set_grads({"d": rank + 1.0, "g": 4.0 * rank, "e": 6.0 * (rank + 1)})
    counts = gdp.allreduce_gradients()
    return (gdp.module is m, gdp.dp_group, gdp.expert_dp_group, gdp.expert_scale, out.item(), counts, m.grads(),
            m.values())


def test_grouped_data_parallel_wraps_broadcasts_and_reduces():
    got = run_ranks(_gdp, 2, "mean")
    for rank, (same, dp, edp, scale, out, counts, grads, values) in enumerate(got):
        assert (same, dp, edp, scale, out, counts) == (True, None, None, "mean", 3.0, COUNTS)
        assert grads == {"d": 1.5, "g": 2.0, "e": 3.0 * (rank + 1)}          # e: 6 (r + 1) / 2
        assert values == {"d": 0.0, "g": 0.0, "e": float(rank)}
    assert [g[6]["e"] for g in run_ranks(_gdp, 2, "sum")] == [6.0, 12.0]


# ---- refusals ---------------------------------------------------------------------------------------------------
class Heads(nn.Module):
    """A body and one head per name in ``heads``, each ``nn.Linear(4, 2)``; uses the heads in ``use``."""

    def __init__(self, heads=("head",), use=None):
        super().__init__()
        self.body = nn.Linear(4, 4)
        for h in heads:
            setattr(self, h, nn.Linear(4, 2))
        self.use = list(use if use is not None else heads)

    def forward(self, x):
        z = self.body(x)
        return sum(getattr(self, h)(z).sum() for h in self.use)


def _backward(m, rank):
    m.zero_grad(set_to_none=True)
    m(torch.full((3, 4), rank + 1.0)).backward()


def _refusals():
    rank = dist.get_rank()
    out = {}
    torch.manual_seed(rank)
    m = Heads(("head_a",) if rank == 0 else ("head_b",))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out["heads at wrap"] = caught(lambda: GroupedDataParallel(m))
    out["heads nothing broadcast"] = all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    gdp = GroupedDataParallel(m, sync_params=False)
    _backward(m, rank)
    local = {n: p.grad.clone() for n, p in m.named_parameters()}
    out["heads at reduce"] = caught(gdp.allreduce_gradients)
    out["heads nothing reduced"] = all(torch.equal(p.grad, local[n]) for n, p in m.named_parameters())
    out["heads fastmoe wrapper"] = caught(lambda: DistributedGroupedDataParallel(m))

    m = Heads()
    if rank == 0:
        mark_expert_params(m.head)
    out["expert tag on rank 0 only"] = caught(lambda: GroupedDataParallel(m))

    m = Heads(("a", "b"), use=("a", "b") if rank == 0 else ("a",))
    gdp, dgdp = GroupedDataParallel(m), DistributedGroupedDataParallel(m)
    _backward(m, rank)
    out["grad on one rank"] = caught(gdp.allreduce_gradients)
    out["grad on one rank, fastmoe wrapper"] = caught(dgdp.allreduce_gradients)

    m = Heads()
    m.body.weight.dp_comm = "DP"
    out["DP tag at wrap"] = caught(lambda: DistributedGroupedDataParallel(m))
    out["DP tag without sync"] = caught(lambda: DistributedGroupedDataParallel(m, need_sync=False))
    out["DP tag at reduce"] = caught(lambda: allreduce_grouped_grads(m))
    return out


def test_replicas_that_disagree_are_refused_before_anything_moves():
    ranks = run_ranks(_refusals, 2)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    held = ("parameters ['head_a.weight', 'head_a.bias'] are held by rank 0 only; parameters ['head_b.weight', "
            "'head_b.bias'] are held by rank 1 only" + EVERY)
    assert got["heads at wrap"] == ("CollectiveMismatch", "broadcast_grouped_params: " + held)
    assert got["heads at reduce"] == ("CollectiveMismatch", "allreduce_grouped_grads: " + held)
    assert got["heads fastmoe wrapper"] == ("CollectiveMismatch", "DistributedGroupedDataParallel (its start-up "
                                                                  "broadcast): " + held)
    assert got["heads nothing broadcast"] is True and got["heads nothing reduced"] is True
    assert got["expert tag on rank 0 only"] == (
        "CollectiveMismatch", "broadcast_grouped_params: 'head.weight' gradient group: rank 0 expert, rank 1 dp; "
                              "'head.bias' gradient group: rank 0 expert, rank 1 dp" + EVERY)
    hint = (" (the ranks that reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
            "give it a zero gradient)")
    grads = "'b.weight' gradient: rank 0 grad, rank 1 no grad; 'b.bias' gradient: rank 0 grad, rank 1 no grad"
    assert got["grad on one rank"] == ("CollectiveMismatch", "allreduce_grouped_grads: " + grads + hint + EVERY)
    assert got["grad on one rank, fastmoe wrapper"] == (
        "CollectiveMismatch", "DistributedGroupedDataParallel.allreduce_gradients: " + grads + hint + EVERY)
    accepted = ("is not a tag any group reduces; accepted: ['dp', 'expert', 'gate', 'moe', 'mp', 'none', 'world'] (or "
                "reduce it over a group of your own with DP_group=)")
    assert got["DP tag at wrap"] == (
        "CollectiveMismatch", "DistributedGroupedDataParallel (its start-up broadcast): rank 0 parameter "
                              f"'body.weight': dp_comm='DP' on a parameter of shape (4, 4) {accepted}; rank 1 "
                              f"parameter 'body.weight': dp_comm='DP' on a parameter of shape (4, 4) {accepted}"
                              + EVERY)
    assert got["DP tag without sync"] == ("ValueError", "DistributedGroupedDataParallel: parameter 'body.weight': "
                                                        f"dp_comm='DP' on a parameter of shape (4, 4) {accepted}")
    assert got["DP tag at reduce"] == (
        "CollectiveMismatch", "allreduce_grouped_grads: rank 0 parameter 'body.weight': unknown dp_comm 'DP' on a "
                              "parameter of shape (4, 4); expected one of ['dp', 'expert', 'gate', 'none', 'world']; "
                              "rank 1 parameter 'body.weight': unknown dp_comm 'DP' on a parameter of shape (4, 4); "
                              "expected one of ['dp', 'expert', 'gate', 'none', 'world']" + EVERY)


def _setup_differs(case):
    rank = dist.get_rank()
    m = Tagged(TAGS)
    without_e = rank == 1 and case.startswith("expert grad")
    m.set_grads({"d": 1.0, "g": 1.0} if without_e else {"d": 1.0, "g": 1.0, "e": 1.0})
    if case == "scale":
        return caught(lambda: allreduce_grouped_grads(m, expert_scale="mean" if rank == 0 else "sum"))
    if case == "expert group":
        group = dist.new_group([0, 1])
        return caught(lambda: allreduce_grouped_grads(m, expert_dp_group=group if rank == 0 else None))
    if case == "expert grad":                       # experts with no replicas: a missing gradient is fine
        return caught(lambda: allreduce_grouped_grads(m))
    if case == "expert grad, replicated":           # ... but not when the replicas reduce it
        group = dist.new_group([0, 1])
        return caught(lambda: allreduce_grouped_grads(m, expert_dp_group=group))
    raise AssertionError(case)


def test_ranks_that_differ_in_settings_or_in_expert_gradients():
    assert alike(run_ranks(_setup_differs, 2, "scale")) == (
        "CollectiveMismatch", "allreduce_grouped_grads: ranks differ in expert_scale: rank 0 'mean', rank 1 'sum'"
                              + EVERY)
    assert alike(run_ranks(_setup_differs, 2, "expert group")) == (
        "CollectiveMismatch", "allreduce_grouped_grads: ranks differ in expert_dp_group: rank 0 'given', rank 1 None"
                              + EVERY)
    assert run_ranks(_setup_differs, 2, "expert grad") == [("ok", {"dp": 1, "world": 1, "expert": 1}),
                                                           ("ok", {"dp": 1, "world": 1, "expert": 0})]
    assert alike(run_ranks(_setup_differs, 2, "expert grad, replicated")) == (
        "CollectiveMismatch", "allreduce_grouped_grads: 'e' gradient: rank 0 grad, rank 1 no grad (the ranks that "
                              "reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
                              "give it a zero gradient)" + EVERY)


# ---- DistributedGroupedDataParallel ----------------------------------------------------------------------------
FAST_TAGS = {"d": None, "g": "gate", "n": "none", "w": "world", "m": "moe", "p": "mp"}


def _dgdp(kwargs_of, need_sync=True):
    rank = dist.get_rank()
    kwargs = kwargs_of(rank)
    m = Tagged(FAST_TAGS, lambda name: 10 * rank + list(FAST_TAGS).index(name))
    dgdp = DistributedGroupedDataParallel(m, need_sync=need_sync, **kwargs)
    values = m.values()
    m.set_grads({n: 6.0 * (rank + 1) for n in FAST_TAGS})
    return dgdp, m, values


def _dgdp_default():
    dgdp, m, values = _dgdp(lambda rank: {})
    comms = {k: (g is dist.group.WORLD) for k, g in dgdp.comms.items()}
    out = dgdp(torch.tensor([2.0])).item()
    dgdp.allreduce_gradients()
    return comms, values, m.grads(), out


def test_fastmoe_wrapper_defaults_every_tag_with_a_group_to_every_rank():
    got = run_ranks(_dgdp_default, 3)
    for rank, (comms, values, grads, out) in enumerate(got):
        assert comms == {"dp": True, "gate": True, "moe": True, "world": True} and out == 4.0
        # synced from rank 0: d 0, g 1, w 3, m 4; "none" and "mp" (no group) keep each rank's own
        assert values == {"d": 0.0, "g": 1.0, "n": 10.0 * rank + 2, "w": 3.0, "m": 4.0, "p": 10.0 * rank + 5}
        # gradients 6, 12, 18 -> 12 where a group reduces them; "none" and "mp" keep their own
        assert grads == {"d": 12.0, "g": 12.0, "n": 6.0 * (rank + 1), "w": 12.0, "m": 12.0, "p": 6.0 * (rank + 1)}


def _dgdp_groups():
    def kwargs_of(rank):
        dp = [dist.new_group([0, 1]), dist.new_group([2])]
        mp = [dist.new_group([0]), dist.new_group([1, 2])]
        none = dist.new_group([0, 1, 2])
        return {"dp_group": dp[rank // 2], "mp_group": mp[min(rank, 1)], "none_group": none}
    dgdp, m, values = _dgdp(kwargs_of)
    dgdp.allreduce_params()
    return sorted(dgdp.comms), values, m.grads()


def test_fastmoe_wrapper_with_groups_of_its_own():
    got = run_ranks(_dgdp_groups, 3)
    assert all(g[0] == ["dp", "gate", "moe", "mp", "none", "world"] for g in got)
    # sync: d from the first rank of {0, 1} / {2}; p from {0} / {1, 2}; n over every rank (none_group=)
    assert [v for _, v, _ in got] == [
        {"d": 0.0, "g": 1.0, "n": 2.0, "w": 3.0, "m": 4.0, "p": 5.0},
        {"d": 0.0, "g": 1.0, "n": 2.0, "w": 3.0, "m": 4.0, "p": 15.0},
        {"d": 20.0, "g": 1.0, "n": 2.0, "w": 3.0, "m": 4.0, "p": 15.0}]
    # gradients 6, 12, 18: d over {0, 1} -> 9, alone -> 18; p alone -> 6, over {1, 2} -> 15; the rest -> 12
    assert [g for _, _, g in got] == [{"d": 9.0, "g": 12.0, "n": 12.0, "w": 12.0, "m": 12.0, "p": 6.0},
                                      {"d": 9.0, "g": 12.0, "n": 12.0, "w": 12.0, "m": 12.0, "p": 15.0},
                                      {"d": 18.0, "g": 12.0, "n": 12.0, "w": 12.0, "m": 12.0, "p": 15.0}]


def _dgdp_no_sync_and_scales(how):
    dgdp, m, values = _dgdp(lambda rank: {}, need_sync=False)
    m.p.grad = None                                                      # a parameter without a gradient
    getattr(dgdp, "allreduce_params" if how.startswith("alias") else "allreduce_gradients")(
        no_scale=how.endswith("no_scale"))
    return values, m.grads()


def test_fastmoe_wrapper_without_sync_and_without_scaling():
    got = run_ranks(_dgdp_no_sync_and_scales, 2, "no_scale")
    for rank, (values, grads) in enumerate(got):
        assert values == {n: 10.0 * rank + i for i, n in enumerate(FAST_TAGS)}   # nothing synced
        # 6 and 12 summed, not divided: 18; "none" keeps its own; "mp" had no gradient
        assert grads == {"d": 18.0, "g": 18.0, "n": 6.0 * (rank + 1), "w": 18.0, "m": 18.0, "p": None}
    assert [g["d"] for _, g in run_ranks(_dgdp_no_sync_and_scales, 2, "alias no_scale")] == [18.0, 18.0]
    assert [g["d"] for _, g in run_ranks(_dgdp_no_sync_and_scales, 2, "alias")] == [9.0, 9.0]


def _dgdp_rounding(reduce_after, fp32, alias):
    rank = dist.get_rank()
    m = Tagged({"h": None}, dtypes={"h": torch.float16})
    dgdp = DistributedGroupedDataParallel(m)
    m.h.grad = torch.full((2,), [2047.0, 1.0, 1.0][rank], dtype=torch.float16)
    if alias:
        dgdp.allreduce_params(False, reduce_after, fp32)
    else:
        dgdp.allreduce_gradients(reduce_after=reduce_after, fp32_allreduce=fp32)
    return m.h.grad.dtype, m.h.grad[0].item()


@pytest.mark.parametrize("alias", [False, True])
def test_fastmoe_wrapper_divides_before_or_after_the_sum_in_half_or_single_precision(alias):
    # float16 gradients 2047, 1, 1 on 3 ranks (float16 holds whole numbers up to 2048, then steps of 2):
    # divide after the sum, in float16: 2049 rounds to 2048, / 3 = 682.67 rounds to 682.5 (steps of 0.5 there);
    # the same in float32 (fp32_allreduce): 2049 / 3 = 683 exactly; divide first: 682.33 -> 682.5, twice 1/3 ->
    # 0.33325, sum 683.17 -> 683 in float16
    half = torch.float16
    assert run_ranks(_dgdp_rounding, 3, True, False, alias) == [(half, 682.5)] * 3
    assert run_ranks(_dgdp_rounding, 3, True, True, alias) == [(half, 683.0)] * 3
    assert run_ranks(_dgdp_rounding, 3, False, False, alias) == [(half, 683.0)] * 3


@pytest.mark.parametrize("alias", [False, True])
def test_fastmoe_wrapper_defaults_divide_first_in_the_gradients_precision(alias):
    # float16 gradients 100, 3, 1 on 3 ranks, defaults (divide first, no float32): 33.34, 1.0, 0.3335 in float16,
    # summed: 34.69 -> 34.6875; in float32 (fp32_allreduce) or dividing after the sum it would be 34.65625
    got = run_ranks(_dgdp_defaults_rounding, 3, alias)
    assert got == [(torch.float16, 34.6875)] * 3


def _dgdp_defaults_rounding(alias):
    rank = dist.get_rank()
    m = Tagged({"h": None}, dtypes={"h": torch.float16})
    dgdp = DistributedGroupedDataParallel(m)
    m.h.grad = torch.full((2,), [100.0, 3.0, 1.0][rank], dtype=torch.float16)
    dgdp.allreduce_params() if alias else dgdp.allreduce_gradients()
    return m.h.grad.dtype, m.h.grad[0].item()


def _grouped_half():
    rank = dist.get_rank()
    m = Tagged({"h": None}, dtypes={"h": torch.float16})
    m.h.grad = torch.full((2,), [2047.0, 1.0, 1.0][rank], dtype=torch.float16)
    allreduce_grouped_grads(m)
    return m.h.grad[0].item()


def test_grouped_gradients_are_summed_then_divided():
    # float16 2047 + 1 + 1 = 2049 rounds to 2048, / 3 = 682.67 rounds to 682.5 (dividing first would give 683)
    assert run_ranks(_grouped_half, 3) == [682.5] * 3


# ---- which ranks each check compares ----------------------------------------------------------------------------
def _dp_groups_hold_different_models(op):
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    dp = groups[rank // 2]
    m = Tagged({"a": None} if rank < 2 else {"b": None, "c": None}, lambda n: 10 * rank + 1)
    m.set_grads({n: rank + 1.0 for n in "abc"})
    if op == "reduce":
        return caught(lambda: (allreduce_grouped_grads(m, dp_group=dp), m.grads())[1])
    if op == "broadcast":
        return caught(lambda: (broadcast_grouped_params(m, dp_group=dp), m.values())[1])
    gdp = GroupedDataParallel(m, dp_group=dp)
    return caught(lambda: (gdp.allreduce_gradients(), m.grads(), gdp.dp_group is dp)[1:])


@pytest.mark.parametrize("op", ["reduce", "broadcast", "wrapper"])
def test_each_data_parallel_group_is_checked_on_its_own(op):
    # ranks 0, 1 train one model, rank 2 another: each dp group agrees within itself, so nothing is refused
    got = run_ranks(_dp_groups_hold_different_models, 3, op)
    if op == "reduce":
        assert got == [("ok", {"a": 1.5}), ("ok", {"a": 1.5}), ("ok", {"b": 3.0, "c": 3.0})]
    elif op == "broadcast":
        assert got == [("ok", {"a": 1.0}), ("ok", {"a": 1.0}), ("ok", {"b": 21.0, "c": 21.0})]
    else:
        assert got == [("ok", ({"a": 1.5}, True)), ("ok", ({"a": 1.5}, True)), ("ok", ({"b": 3.0, "c": 3.0}, True))]


def _expert_replicas_differ_in_gradients(wrapper):
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    edp = groups[rank % 2]
    m = Tagged({"d": None, "e": "expert"})
    m.set_grads({"d": 1.0, "e": 4.0 * (rank + 1)} if rank % 2 == 0 else {"d": 1.0})  # experts 1, 3 got no token
    if wrapper:
        gdp = GroupedDataParallel(m, expert_dp_group=edp, expert_scale="sum")
        return caught(lambda: (gdp.allreduce_gradients(), m.grads(), gdp.expert_dp_group is edp))
    return caught(lambda: (allreduce_grouped_grads(m, expert_dp_group=edp, expert_scale="sum"), m.grads()))


@pytest.mark.parametrize("wrapper", [False, True])
def test_expert_gradients_are_compared_within_their_replica_group_only(wrapper):
    # replicas {0, 2} both have an expert gradient (4 + 12 = 16), replicas {1, 3} neither: nothing is refused
    got = run_ranks(_expert_replicas_differ_in_gradients, 4, wrapper)
    with_e = {"dp": 1, "world": 0, "expert": 1}
    without = {"dp": 1, "world": 0, "expert": 0}
    tail = (True,) if wrapper else ()
    assert got == [("ok", (with_e, {"d": 1.0, "e": 16.0}) + tail), ("ok", (without, {"d": 1.0, "e": None}) + tail),
                   ("ok", (with_e, {"d": 1.0, "e": 16.0}) + tail), ("ok", (without, {"d": 1.0, "e": None}) + tail)]


def _singleton_expert_groups(_unused):
    rank = dist.get_rank()
    groups = [dist.new_group([0]), dist.new_group([1])]
    m = Tagged({"d": None, "e": "expert"})
    m.set_grads({"d": 1.0, "e": 6.0} if rank == 0 else {"d": 1.0})
    counts = allreduce_grouped_grads(m, expert_dp_group=groups[rank])
    return counts, m.grads()


def test_expert_groups_of_one_rank_move_nothing(monkeypatch):
    calls = _count_collectives(monkeypatch)
    got = run_ranks(_singleton_expert_groups, 2, None)
    # every expert lives on one rank: divided by the dp size (2) locally, compared with nobody
    assert got == [({"dp": 1, "world": 0, "expert": 1}, {"d": 1.0, "e": 3.0}),
                   ({"dp": 1, "world": 0, "expert": 0}, {"d": 1.0, "e": None})]
    assert [c[1] for c in calls if c[0] == 0] == ["all_reduce"]          # the dense gradient only


def test_expert_groups_of_one_rank_need_one_small_gather(monkeypatch):
    gathers = []
    real = dist.all_gather_object

    def counted(*args, **kwargs):
        gathers.append(dist.get_rank())
        return real(*args, **kwargs)
    monkeypatch.setattr(dist, "all_gather_object", counted)
    run_ranks(_singleton_expert_groups, 2, None)
    assert gathers == []                     # the ranks agree (experts not compared): no gather of parameter lists


def _gate_grad_on_one_rank():
    rank = dist.get_rank()
    m = Tagged({"g": "gate"})
    m.set_grads({"g": 1.0} if rank == 0 else {})
    return caught(lambda: allreduce_grouped_grads(m))


def test_a_gate_gradient_on_one_rank_only_is_refused():
    assert alike(run_ranks(_gate_grad_on_one_rank, 2)) == (
        "CollectiveMismatch", "allreduce_grouped_grads: 'g' gradient: rank 0 grad, rank 1 no grad (the ranks that "
                              "reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
                              "give it a zero gradient)" + EVERY)


def _wrap_with_gradients_on_one_rank(which):
    rank = dist.get_rank()
    m = Tagged({"d": None}, lambda n: rank + 1.0)
    m.set_grads({"d": 1.0} if rank == 0 else {})              # left over from an earlier step on rank 0 only
    if which == "broadcast":
        return caught(lambda: (broadcast_grouped_params(m), m.values())[1])
    return caught(lambda: (DistributedGroupedDataParallel(m), m.values())[1])


@pytest.mark.parametrize("which", ["broadcast", "fastmoe wrapper"])
def test_the_start_up_broadcast_does_not_look_at_gradients(which):
    assert run_ranks(_wrap_with_gradients_on_one_rank, 2, which) == [("ok", {"d": 1.0})] * 2


def _broadcast_expert_group_on_one_rank():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    return caught(lambda: broadcast_grouped_params(Tagged(TAGS), expert_dp_group=group if rank == 0 else None))


def test_broadcast_refuses_ranks_that_differ_in_expert_groups():
    assert alike(run_ranks(_broadcast_expert_group_on_one_rank, 2)) == (
        "CollectiveMismatch", "broadcast_grouped_params: ranks differ in expert_dp_group: rank 0 'given', rank 1 None"
                              + EVERY)


class Scaled(Tagged):
    def forward(self, x, scale=1.0):
        return x * scale


def _keyword_forward():
    m = Scaled({"d": None})
    return GroupedDataParallel(m)(torch.tensor([2.0]), scale=3.0).item(), \
        DistributedGroupedDataParallel(m)(torch.tensor([2.0]), scale=5.0).item()


def test_wrappers_pass_keyword_arguments_to_the_module():
    assert run_ranks(_keyword_forward, 2) == [(6.0, 10.0)] * 2


def _gdp_with_groups():
    rank = dist.get_rank()
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    edp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    m = Tagged(TAGS)
    gdp = GroupedDataParallel(m, dp_group=dp, expert_dp_group=edp, sync_params=False)
    m.set_grads({"d": rank + 1.0, "g": rank + 1.0, "e": 4.0 * (rank + 1)})
    gdp.allreduce_gradients()
    return m.grads()


def test_grouped_data_parallel_reduces_over_its_own_groups():
    # d over dp {0, 1} / {2, 3}: 1.5, 3.5; g over all 4: 2.5; e summed over {0, 2} / {1, 3} (4 + 12, 8 + 16) and
    # divided by the dp size 2
    assert run_ranks(_gdp_with_groups, 4) == [{"d": 1.5, "g": 2.5, "e": 8.0}, {"d": 1.5, "g": 2.5, "e": 12.0},
                                              {"d": 3.5, "g": 2.5, "e": 8.0}, {"d": 3.5, "g": 2.5, "e": 12.0}]


# ---- DistributedGroupedDataParallel: its check -----------------------------------------------------------------
def _dgdp_case(case):
    rank = dist.get_rank()
    if case == "tag":
        m = Tagged({"w": "dp" if rank == 0 else "gate"})
        return caught(lambda: DistributedGroupedDataParallel(m))
    if case == "groups":
        mp = dist.new_group([0, 1])
        m = Tagged({"w": None})
        return caught(lambda: DistributedGroupedDataParallel(m, **({"mp_group": mp} if rank == 0 else {})))
    if case == "dp groups, a gradient in one":
        dp = [dist.new_group([0, 1]), dist.new_group([2])][rank // 2]
        m = Tagged({"d": None, "w": "world"})
        ddp = DistributedGroupedDataParallel(m, dp_group=dp)
        m.set_grads({"d": rank + 1.0, "w": 3.0} if rank < 2 else {"w": 3.0})   # rank 2's d unused
        return caught(lambda: (ddp.allreduce_gradients(), m.grads())[1])
    if case == "world groups":
        world = [dist.new_group([0, 1]), dist.new_group([2])][rank // 2]
        m = Tagged({"p": "mp"}, shape=(2,) if rank < 2 else (3,))
        return caught(lambda: (DistributedGroupedDataParallel(m, world_group=world, need_sync=False)
                               .allreduce_gradients(), "checked")[1])
    if case == "frozen and unused":
        m = Tagged({"d": None, "frozen": None, "unused": None})
        m.frozen.requires_grad_(False)
        ddp = DistributedGroupedDataParallel(m)
        m.set_grads({"d": rank + 1.0, "frozen": 7.0 + rank})            # a stale gradient on a frozen parameter
        return caught(lambda: (ddp.allreduce_gradients(), m.grads())[1])
    raise AssertionError(case)


def test_fastmoe_wrapper_names_its_tags_and_groups_in_its_refusals():
    assert alike(run_ranks(_dgdp_case, 2, "tag")) == (
        "CollectiveMismatch", "DistributedGroupedDataParallel (its start-up broadcast): 'w' dp_comm: rank 0 dp, rank 1 "
                              "gate" + EVERY)
    assert alike(run_ranks(_dgdp_case, 2, "groups")) == (
        "CollectiveMismatch", "DistributedGroupedDataParallel (its start-up broadcast): ranks differ in groups: rank 0 "
                              "['dp', 'gate', 'moe', 'mp', 'world'], rank 1 ['dp', 'gate', 'moe', 'world']" + EVERY)


def test_fastmoe_wrapper_compares_gradients_within_each_tags_group():
    # dp groups {0, 1} and {2}: rank 2 alone has no d gradient, which nobody else reduces with it
    assert run_ranks(_dgdp_case, 3, "dp groups, a gradient in one") == [
        ("ok", {"d": 1.5, "w": 3.0}), ("ok", {"d": 1.5, "w": 3.0}), ("ok", {"d": None, "w": 3.0})]


def test_fastmoe_wrapper_checks_over_its_world_group():
    assert run_ranks(_dgdp_case, 3, "world groups") == [("ok", "checked")] * 3


def test_fastmoe_wrapper_leaves_frozen_and_unused_parameters_alone():
    assert run_ranks(_dgdp_case, 2, "frozen and unused") == [
        ("ok", {"d": 1.5, "frozen": 7.0, "unused": None}), ("ok", {"d": 1.5, "frozen": 8.0, "unused": None})]


# ---- argument errors, raised before any collective (pins found by mutation testing, labutils/data_parallel.py) ----
def test_fastmoe_wrapper_refuses_auto_allreduce_and_a_keyword_that_is_not_a_group():
    with pytest.raises(NotImplementedError) as err:
        DistributedGroupedDataParallel(nn.Linear(2, 2), auto_allreduce=True)
    assert str(err.value) == ("auto_allreduce=True: fastmoe has not implemented it either; call "
                              "model.allreduce_gradients() after backward()")
    with pytest.raises(TypeError) as err:
        DistributedGroupedDataParallel(nn.Linear(2, 2), dp_group=None, bucket_size=4)
    assert str(err.value) == ("DistributedGroupedDataParallel got ['bucket_size']; its groups are keyword arguments "
                              "ending in _group (dp_group=, mp_group=, gate_group=, moe_group=, world_group=)")


def test_allreduce_grouped_grads_names_a_bad_expert_scale_and_itself_without_a_process_group(monkeypatch):
    with pytest.raises(ValueError) as err:
        allreduce_grouped_grads(nn.Linear(2, 2), expert_scale="avg")
    assert str(err.value) == "expert_scale must be 'mean' or 'sum', not 'avg'"
    # torch.distributed not initialised (patched, so the test does not depend on what ran before it)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"^allreduce_grouped_grads needs a process group, but torch.distributed "
                                           r"is not initialised"):
        allreduce_grouped_grads(nn.Linear(2, 2))
