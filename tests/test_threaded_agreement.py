"""labutils.agreement on 2 and 3 in-process ranks (tests/threaded_ranks.py): the one metadata collective
(gather_rows), the verdicts every rank computes alike (disagreements, check_gather, check_all_to_all,
check_replicas) and their messages, written out by hand. tests/test_bad_input_ranks.py runs the same refusals in
gloo workers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_ranks import run_ranks
from torch import nn

from labutils.agreement import (
    BAD_DIM,
    BAD_SPLITS,
    DTYPES,
    MAX_DIMS,
    OK,
    TOO_MANY_DIMS,
    ZERO_DIM,
    CollectiveMismatch,
    _digest,
    _replica_problems,
    check_all_to_all,
    check_gather,
    check_replicas,
    disagreements,
    dtype_code,
    dtype_name,
    gather_rows,
    local_problem,
    raise_everywhere,
    require_process_group,
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


# ---- without ranks ---------------------------------------------------------------------------------------------
def test_codes_and_limits():
    assert (OK, ZERO_DIM, BAD_DIM, TOO_MANY_DIMS, BAD_SPLITS) == (0, 1, 2, 3, 4)
    assert MAX_DIMS == 16
    assert DTYPES == sorted(DTYPES, key=str) and len(set(DTYPES)) == len(DTYPES)
    assert torch.float32 in DTYPES and torch.bool in DTYPES and torch.int8 in DTYPES




def test_dtype_codes_round_trip_and_unknown_codes_read_as_placeholders():
    for code, dtype in enumerate(DTYPES):
        assert dtype_code(dtype) == code and dtype_name(code) is dtype
    assert dtype_name(-1) == "dtype #-1"
    assert dtype_name(len(DTYPES)) == f"dtype #{len(DTYPES)}"
    assert dtype_name(len(DTYPES) - 1) is DTYPES[-1]
    with pytest.raises(TypeError) as info:
        dtype_code("float32")  # type: ignore[arg-type]
    assert str(info.value) == ("dtype_code: dtype must be a torch.dtype such as torch.float32, got the str 'float32' "
                               "(pass torch.float32)")
    with pytest.raises(TypeError) as info:
        dtype_code("floaty")  # type: ignore[arg-type]
    assert str(info.value).endswith("got the str 'floaty'")
    with pytest.raises(TypeError) as info:
        dtype_code("Tensor")  # type: ignore[arg-type]   (torch.Tensor exists but is not a dtype)
    assert str(info.value).endswith("got the str 'Tensor'")
    with pytest.raises(TypeError, match=r"got the NoneType None$"):
        dtype_code(None)  # type: ignore[arg-type]


def test_disagreements_one_line_per_differing_column():
    rows = torch.tensor([[1, 2, 3], [1, 5, 3], [1, 2, 4]])                 # (W=3, fields)
    assert disagreements(rows, ["a", "b", "c"]) == {"b": "b: rank 0=2, rank 1=5, rank 2=2",
                                                   "c": "c: rank 0=3, rank 1=3, rank 2=4"}
    assert list(disagreements(rows, ["a", "b", "c"])) == ["b", "c"]        # column order
    assert disagreements(rows[[0, 0, 0]], ["a", "b", "c"]) == {}
    assert disagreements(rows[:1], ["a", "b", "c"]) == {}                  # one rank agrees with itself
    shown = disagreements(rows, ["a", "b", "c"], show={"c": lambda v: f"<{v}>"})
    assert shown == {"b": "b: rank 0=2, rank 1=5, rank 2=2", "c": "c: rank 0=<3>, rank 1=<3>, rank 2=<4>"}
    f32, f64 = dtype_code(torch.float32), dtype_code(torch.float64)
    assert disagreements(torch.tensor([[f32], [f64]]), ["dtype"], show={"dtype": dtype_name}) == {
        "dtype": "dtype: rank 0=torch.float32, rank 1=torch.float64"}


def test_disagreements_refuses_rows_that_do_not_fit_the_names():
    rows = torch.tensor([[1, 2, 3], [1, 5, 3]])
    with pytest.raises(ValueError) as info:
        disagreements(rows, ["a", "b"])
    assert str(info.value) == ("disagreements: names has 2 entries but rows has shape (2, 3): give one name per column "
                               "(3), rows as (world, fields)")
    with pytest.raises(ValueError, match=r"names has 4 entries but rows has shape \(2, 3\): give one name per column "
                                         r"\(3\)"):
        disagreements(rows, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"names has 3 entries but rows has shape \(3,\): give one name per column "
                                         r"\(3\)"):
        disagreements(rows[0], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"names has 1 entries but rows has shape \(\): give one name per column "
                                         r"\(0\)"):
        disagreements(torch.tensor(1), ["a"])
    with pytest.raises(ValueError, match=r"rows has shape \(1, 1, 1\)"):
        disagreements(torch.ones(1, 1, 1), ["a"])


def test_raise_everywhere():
    assert raise_everywhere("thing", []) is None
    with pytest.raises(CollectiveMismatch) as info:
        raise_everywhere("thing", ["one", "two"])
    assert str(info.value) == "thing: one; two (raised on every rank before any data moved)"
    with pytest.raises(IndexError) as index_info:
        raise_everywhere("other", ["three"], IndexError)
    assert str(index_info.value) == "other: three (raised on every rank before any data moved)"
    assert type(index_info.value) is IndexError
    assert issubclass(CollectiveMismatch, ValueError)


def test_local_problem_codes_and_texts():
    two = torch.ones(2, 3)
    assert local_problem(two, 0) == (OK, "") == local_problem(two, 1) == local_problem(two, -2) == \
        local_problem(two, -1) == local_problem(two, None)
    assert local_problem(torch.tensor(1.0), None) == (OK, "")
    assert local_problem(torch.tensor(1.0), 0) == (ZERO_DIM, "passed a 0-d tensor (a scalar); gather t.reshape(1) "
                                                             "instead")
    assert local_problem(two, 2) == (BAD_DIM, "passed dim=2, out of range for a tensor with ndim=2 (expected -2..1)")
    assert local_problem(two, -3) == (BAD_DIM, "passed dim=-3, out of range for a tensor with ndim=2 (expected -2..1)")
    big = torch.ones([1] * 17)
    text = "passed a tensor with ndim=17 (the checked collectives take at most 16; pass check=False)"
    assert local_problem(big, None) == (TOO_MANY_DIMS, text) == local_problem(big, 0)
    assert local_problem(torch.ones([1] * 16), 15) == (OK, "")
    assert local_problem(big, 17)[0] == BAD_DIM


def test_digest_is_the_same_for_equal_items_and_differs_otherwise():
    a = _digest([("w", (2, 3), "torch.float32", "dp")])
    assert a == _digest([("w", (2, 3), "torch.float32", "dp")])
    assert a != _digest([("w", (3, 2), "torch.float32", "dp")])
    assert isinstance(a, int) and -(2 ** 63) <= a < 2 ** 63
    assert _digest([]) != _digest([()])
    # 8 bytes, little endian, signed: blake2b of repr("x")
    import hashlib
    want = int.from_bytes(hashlib.blake2b(b"'x'", digest_size=8).digest(), "little", signed=True)
    assert _digest("x") == want


# ---- gather_rows ------------------------------------------------------------------------------------------------
def _rows(check_length, subgroup):
    rank = dist.get_rank()
    group = dist.new_group([0, 2]) if subgroup else None
    if subgroup and rank == 1:
        return None
    rows = gather_rows([rank, 7, -rank], torch.zeros(1), group, check_length=check_length)
    return rows.tolist(), rows.dtype, rows.device.type


@pytest.mark.parametrize("check_length", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_gather_rows_stacks_every_ranks_row(world, check_length):
    want = [[r, 7, -r] for r in range(world)]
    assert run_ranks(_rows, world, check_length, False) == [(want, torch.int64, "cpu")] * world


def test_gather_rows_over_a_subgroup():
    want = ([[0, 7, 0], [2, 7, -2]], torch.int64, "cpu")
    assert run_ranks(_rows, 3, True, True) == [want, None, want]


def _rows_errors():
    rank = dist.get_rank()
    return {"lengths": caught(lambda: gather_rows([1, 2, 3][:2 + (rank == 1)], torch.zeros(1), None)),
            "nested": caught(lambda: gather_rows([[1, 2], [3, 4]], torch.zeros(1), None)),
            "scalar": caught(lambda: gather_rows(5, torch.zeros(1), None)),  # type: ignore[arg-type]
            "world size": caught(lambda: require_process_group(None, 4, "the layer")),
            "right size": caught(lambda: require_process_group(None, 3, "the layer")),
            "empty": caught(lambda: (gather_rows([], torch.zeros(1), None).shape,
                                     gather_rows([], torch.zeros(1), None).dtype)),
            "good after": caught(lambda: gather_rows([rank], torch.zeros(1), None).view(-1).tolist())}


def test_gather_rows_refusals_on_every_rank():
    ranks = run_ranks(_rows_errors, 3)
    got = {case: alike([r[case] for r in ranks]) for case in ranks[0]}
    assert got["lengths"] == ("CollectiveMismatch", "gather_rows: ranks passed rows of different lengths: rank 0 2, "
                                                    "rank 1 3, rank 2 2 (every rank must pass a row of the same "
                                                    "length)" + EVERY)
    assert got["nested"] == ("ValueError", "gather_rows: row must be a flat list of ints, got one of shape (2, 2)")
    assert got["scalar"] == ("ValueError", "gather_rows: row must be a flat list of ints, got one of shape ()")
    assert got["world size"] == ("ValueError", "the layer: world_size=4, but the process group has 3 ranks")
    assert got["right size"] == ("ok", None)
    assert got["empty"] == ("ok", (torch.Size([3, 0]), torch.int64))   # an empty row is still int64
    assert got["good after"] == ("ok", [0, 1, 2])


def _group_size_check():
    sub = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return None
    return (caught(lambda: require_process_group(sub, 2)), caught(lambda: require_process_group(sub, 3, "x")),
            caught(lambda: require_process_group(sub, 3)))


def test_require_process_group_counts_the_ranks_of_the_group_given():
    got = run_ranks(_group_size_check, 3)
    assert got[1] == got[2] == (("ok", None), ("ValueError", "x: world_size=3, but the process group has 2 ranks"),
                                ("ValueError", "this collective: world_size=3, but the process group has 2 ranks"))


def test_require_process_group_without_a_group_names_what_needs_it(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)   # as in a fresh process, whatever ran before
    assert caught(require_process_group) == (
        "RuntimeError", "this collective needs a process group, but torch.distributed is not initialised: run it "
        "inside labutils.launch(...) workers, or call torch.distributed.init_process_group first")
    assert caught(lambda: require_process_group(what="gather_rows"))[1].startswith("gather_rows needs a process")


# ---- check_gather and check_all_to_all, called directly ------------------------------------------------------
def _check_gather(case):
    rank = dist.get_rank()
    t = torch.ones(2 + rank, 3)
    if case == "sizes":
        return caught(lambda: check_gather(t, 0, None, None, "g"))
    if case == "sizes 2-d":
        return caught(lambda: check_gather(t, 0, torch.tensor([[2], [3], [4]]), None, "g"))
    if case == "dim 1":
        return caught(lambda: check_gather(torch.ones(3, 1 + rank), -1, [1, 2, 3], None, "g"))
    if case == "one rank wrong sizes":
        return caught(lambda: check_gather(t, 0, [2, 3, 5] if rank == 2 else None, None, "g"))
    if case == "same dim":
        return caught(lambda: check_gather(torch.ones(2, 3), None, None, None, "g"))
    if case == "problems of all kinds":
        bad = [torch.ones(2, 3), torch.tensor(1.0), torch.ones([1] * 17)][rank]
        return caught(lambda: check_gather(bad, 0 if rank else 5, None, None, "g"))
    if case == "every kind of disagreement":
        x = torch.ones(2, 3 + (rank == 1), dtype=torch.float64 if rank == 2 else torch.float32)
        return caught(lambda: check_gather(x, 0, [2, 2, 1] if rank == 0 else None, None, "g"))
    raise AssertionError(case)


def test_check_gather_returns_the_sizes_and_names_every_disagreement():
    assert run_ranks(_check_gather, 3, "sizes") == [("ok", [2, 3, 4])] * 3
    assert run_ranks(_check_gather, 3, "sizes 2-d") == [("ok", [2, 3, 4])] * 3
    assert run_ranks(_check_gather, 3, "dim 1") == [("ok", [1, 2, 3])] * 3
    assert run_ranks(_check_gather, 3, "same dim") == [("ok", [-1, -1, -1])] * 3
    assert alike(run_ranks(_check_gather, 3, "one rank wrong sizes")) == (
        "CollectiveMismatch", "g: rank 2 passed sizes=[2, 3, 5] but the ranks hold [2, 3, 4] along dim 0" + EVERY)
    assert alike(run_ranks(_check_gather, 3, "problems of all kinds")) == (
        "CollectiveMismatch", "g: rank 0 passed dim=5, out of range for a tensor with ndim=2 (expected -2..1); rank 1 "
                              "passed a 0-d tensor (a scalar); gather t.reshape(1) instead; rank 2 passed a tensor "
                              "with ndim=17 (the checked collectives take at most 16; pass check=False)" + EVERY)
    assert alike(run_ranks(_check_gather, 3, "every kind of disagreement")) == (
        "CollectiveMismatch", "g: ranks disagree on dtype: rank 0 torch.float32, rank 1 torch.float32, rank 2 "
                              "torch.float64 (every rank must pass the same dtype); ranks disagree on the dims other "
                              "than dim 0: rank 0 [3] (ndim 2), rank 1 [4] (ndim 2), rank 2 [3] (ndim 2); rank 0 "
                              "passed sizes=[2, 2, 1] but the ranks hold [2, 2, 2] along dim 0" + EVERY)


def _check_a2a(case):
    rank = dist.get_rank()
    x = torch.ones(2, 3)
    if case == "good":
        return caught(lambda: check_all_to_all(x, [1, 1], [1, 1], "", None))
    if case == "problem":
        return caught(lambda: check_all_to_all(x, [1, 1], [1, 1], "my own words" if rank else "", None))
    if case == "3-d trailing":
        y = torch.ones(2, 3, 4 + rank)
        return caught(lambda: check_all_to_all(y, [1, 1], [1, 1], "", None))
    raise AssertionError(case)


def test_check_all_to_all_directly():
    assert run_ranks(_check_a2a, 2, "good") == [("ok", None)] * 2
    assert alike(run_ranks(_check_a2a, 2, "problem")) == ("CollectiveMismatch", "all_to_all: rank 1 my own words"
                                                          + EVERY)
    assert alike(run_ranks(_check_a2a, 2, "3-d trailing")) == (
        "CollectiveMismatch", "all_to_all: ranks disagree on the dims after dim 0: rank 0 [3, 4], rank 1 [3, 5]"
                              + EVERY)


# ---- check_replicas -------------------------------------------------------------------------------------------
class Params(nn.Module):
    """Parameters from a spec: name -> (shape, dtype, tag); ``grads``: names that get a gradient."""

    def __init__(self, spec: dict, grads=()):
        super().__init__()
        for name, (shape, dtype, tag) in spec.items():
            p = nn.Parameter(torch.zeros(shape, dtype=dtype))
            p.tag = tag
            self.register_parameter(name, p)
            if name in grads:
                p.grad = torch.ones_like(p)


def _tag_of(p):
    return (p.tag, "") if p.tag != "bad" else ("?", "a bad tag")


F32, F64 = torch.float32, torch.float64


def _replicas(specs, grads=None, setups=None, reduced=None, need_grad=False, subgroup=False):
    rank = dist.get_rank()
    group = dist.new_group([0, 2]) if subgroup else None
    if subgroup and rank == 1:
        return None
    me = dist.get_rank(group) if subgroup else rank
    module = Params(specs[me % len(specs)], (grads or [()])[me % len(grads or [()])])
    setup = (setups or [{}])[me % len(setups or [{}])]
    return caught(lambda: check_replicas(module, _tag_of, reduced if reduced is not None else {"dp": 0}, setup, group,
                                         "the wrap", need_grad, "group tag"))


def _run(world, *args, **kwargs):
    return alike([r for r in run_ranks(_replicas, world, *args, **kwargs) if r is not None])


def test_replicas_that_agree_pass():
    spec = {"w": ((2, 3), F32, "dp"), "b": ((3,), F64, "expert")}
    assert _run(3, [spec], [("w", "b")], [{"lr": 0.1}], need_grad=True) == ("ok", None)
    assert _run(2, [{}]) == ("ok", None)                                  # no parameters at all


def test_replicas_that_disagree_are_named():
    a = {"w": ((2, 3), F32, "dp"), "x": ((1,), F32, "dp")}
    cases = {
        "shape": ([a, {"w": ((3, 2), F32, "dp"), "x": ((1,), F32, "dp")}],
                  "'w' shape: rank 0 (2, 3), rank 1 (3, 2)"),
        "dtype": ([a, {"w": ((2, 3), F64, "dp"), "x": ((1,), F32, "dp")}],
                  "'w' dtype: rank 0 torch.float32, rank 1 torch.float64"),
        "tag": ([a, {"w": ((2, 3), F32, "expert"), "x": ((1,), F32, "dp")}],
                "'w' group tag: rank 0 dp, rank 1 expert"),
        "held": ([a, {"w": ((2, 3), F32, "dp"), "y": ((1,), F32, "dp")}],
                 "parameters ['x'] are held by rank 0 only; parameters ['y'] are held by rank 1 only"),
        "order": ([a, {"x": ((1,), F32, "dp"), "w": ((2, 3), F32, "dp")}],
                  "the parameters come in a different order (the flat buffers would add different parameters "
                  "together): parameter #0 is 'w' on rank 0, 'x' on rank 1"),
        "own problem": ([a, {"w": ((2, 3), F32, "bad"), "x": ((1,), F32, "dp")}], "rank 1 parameter 'w': a bad tag"),
    }
    for case, (specs, words) in cases.items():
        assert _run(2, specs) == ("CollectiveMismatch", f"the wrap: {words}" + EVERY), case


def test_replicas_with_different_settings_or_gradients():
    spec = {"w": ((2,), F32, "dp"), "e": ((2,), F32, "expert")}
    assert _run(2, [spec], setups=[{"lr": 0.1, "k": 1}, {"lr": 0.2, "k": 1}]) == (
        "CollectiveMismatch", "the wrap: ranks differ in lr: rank 0 0.1, rank 1 0.2" + EVERY)
    assert _run(2, [spec], setups=[{"lr": 0.1}, {"lr": 0.1, "mode": "x"}]) == (
        "CollectiveMismatch", "the wrap: ranks differ in mode: rank 0 None, rank 1 'x'" + EVERY)
    hint = (" (the ranks that reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
            "give it a zero gradient)")
    assert _run(3, [spec], grads=[("w",), (), ("w",)], reduced={"dp": 0}, need_grad=True) == (
        "CollectiveMismatch", "the wrap: 'w' gradient: rank 0 grad, rank 1 no grad, rank 2 grad" + hint + EVERY)
    assert _run(2, [spec], grads=[("w", "e"), ()], reduced={"dp": 0, "expert": 0}, need_grad=True) == (
        "CollectiveMismatch", "the wrap: 'w' gradient: rank 0 grad, rank 1 no grad; 'e' gradient: rank 0 grad, rank 1 "
                              "no grad" + hint + EVERY)
    # gradients are compared only where they are reduced, and only with need_grad
    assert _run(2, [spec], grads=[("e",), ()], reduced={"dp": 0}, need_grad=True) == ("ok", None)
    assert _run(2, [spec], grads=[("w",), ()], reduced={"dp": 0}, need_grad=False) == ("ok", None)
    assert _run(2, [spec], grads=[("w",), ()], reduced={"dp": -1}, need_grad=True) == ("ok", None)


def _no_grad_for_a_frozen_parameter():
    m = Params({"w": ((2,), F32, "dp"), "f": ((2,), F32, "dp")}, ("w",))
    m.f.requires_grad_(dist.get_rank() == 0)
    return caught(lambda: check_replicas(m, _tag_of, {"dp": 0}, {}, None, "wrap", True))


def test_a_frozen_parameter_is_named_as_such():
    assert alike(run_ranks(_no_grad_for_a_frozen_parameter, 2)) == (
        "CollectiveMismatch", "wrap: 'f' gradient: rank 0 no grad, rank 1 requires_grad=False (the ranks that reduce a "
                              "parameter must all have a gradient for it: use it in every rank's forward, or give it "
                              "a zero gradient)" + EVERY)


def test_replicas_over_a_subgroup_are_named_by_global_rank():
    a = {"w": ((2,), F32, "dp")}
    got = run_ranks(_replicas, 3, [a, {"w": ((3,), F32, "dp")}], subgroup=True)
    assert got[1] is None
    assert got[0] == got[2] == ("CollectiveMismatch", "the wrap: 'w' shape: rank 0 (2,), rank 2 (3,)" + EVERY)


def test_more_than_twelve_problems_are_cut_short():
    a = {f"p{i}": ((1,), F32, "dp") for i in range(14)}
    b = {f"p{i}": ((2,), F32, "dp") for i in range(14)}
    kind, text = _run(2, [a, b])
    lines = text.removeprefix("the wrap: ").removesuffix(EVERY).split("; ")
    assert kind == "CollectiveMismatch" and len(lines) == 13
    assert lines[0] == "'p0' shape: rank 0 (1,), rank 1 (2,)" and lines[11].startswith("'p11' shape")
    assert lines[12] == "... and 2 more"
    a13 = {f"p{i}": ((1,), F32, "dp") for i in range(13)}
    b13 = {f"p{i}": ((2,), F32, "dp") for i in range(13)}
    assert _run(2, [a13, b13])[1].removesuffix(EVERY).split("; ")[-1] == "... and 1 more"
    a12 = {f"p{i}": ((1,), F32, "dp") for i in range(12)}
    b12 = {f"p{i}": ((2,), F32, "dp") for i in range(12)}
    assert _run(2, [a12, b12])[1].removesuffix(EVERY).split("; ")[-1] == "'p11' shape: rank 0 (1,), rank 1 (2,)"


# ---- the verdict itself, without ranks --------------------------------------------------------------------------
def _entry(name, shape=(2,), dtype="torch.float32", tag="dp", group=0, grad="grad"):
    return (name, shape, dtype, tag, group, grad)


def test_replica_problems_own_problems_come_first_and_alone():
    gathered = [("", [_entry("a")], {}), ("it is broken", [_entry("b")], {"x": 1})]
    assert _replica_problems(gathered, [0, 1], "tag") == ["rank 1 it is broken"]
    gathered = [("p0", [], {}), ("", [], {}), ("p2", [], {})]
    assert _replica_problems(gathered, [3, 4, 5], "tag") == ["rank 3 p0", "rank 5 p2"]


def test_replica_problems_held_by_some_ranks_only():
    gathered = [("", [_entry("x"), _entry("y")], {}), ("", [_entry("x"), _entry("z")], {}),
                ("", [_entry("x"), _entry("y")], {})]
    assert _replica_problems(gathered, [0, 1, 2], "tag") == [
        "parameters ['y'] are held by ranks 0, 2 only", "parameters ['z'] are held by rank 1 only"]
    assert _replica_problems(gathered, [4, 6, 8], "tag")[0] == "parameters ['y'] are held by ranks 4, 8 only"


def test_replica_problems_settings_shapes_dtypes_tags():
    gathered = [("", [_entry("w", (2,), "f32", "dp")], {"a": 1, "b": 2}),
                ("", [_entry("w", (3,), "f64", "expert")], {"a": 1, "b": 3})]
    assert _replica_problems(gathered, [0, 1], "kind") == [
        "ranks differ in b: rank 0 2, rank 1 3", "'w' shape: rank 0 (2,), rank 1 (3,)",
        "'w' dtype: rank 0 f32, rank 1 f64", "'w' kind: rank 0 dp, rank 1 expert"]


def test_replica_problems_order_is_reported_once_and_only_alone():
    gathered = [("", [_entry("a"), _entry("b")], {}), ("", [_entry("b"), _entry("a")], {}),
                ("", [_entry("b"), _entry("a")], {})]
    assert _replica_problems(gathered, [0, 1, 2], "tag") == [
        "the parameters come in a different order (the flat buffers would add different parameters together): "
        "parameter #0 is 'a' on rank 0, 'b' on rank 1"]
    gathered = [("", [_entry("a"), _entry("b"), _entry("c")], {}),
                ("", [_entry("a"), _entry("c", (5,)), _entry("b")], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == ["'c' shape: rank 0 (2,), rank 1 (5,)"]
    gathered = [("", [_entry("a"), _entry("b"), _entry("c")], {}), ("", [_entry("a"), _entry("c"), _entry("b")], {})]
    assert _replica_problems(gathered, [0, 1], "tag")[0].endswith("parameter #1 is 'b' on rank 0, 'c' on rank 1")


def test_replica_problems_gradients_compared_within_each_reducing_group():
    hint = (" (the ranks that reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
            "give it a zero gradient)")
    gathered = [("", [_entry("w", group=0, grad="grad")], {}), ("", [_entry("w", group=1, grad="no grad")], {}),
                ("", [_entry("w", group=0, grad="grad")], {}), ("", [_entry("w", group=1, grad="grad")], {})]
    assert _replica_problems(gathered, [0, 1, 2, 3], "tag") == ["'w' gradient: rank 1 no grad, rank 3 grad" + hint]
    gathered = [("", [_entry("w", group=0, grad="grad")], {}), ("", [_entry("w", group=1, grad="no grad")], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == []                # different groups: nothing to compare
    gathered = [("", [_entry("w", group=-1, grad="grad")], {}), ("", [_entry("w", group=-1, grad="no grad")], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == []                # not reduced
    gathered = [("", [_entry("w", grad="")], {}), ("", [_entry("w", grad="no grad")], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == []                # "" : gradients not asked for
    gathered = [("", [_entry("u"), _entry("v")], {}), ("", [_entry("u", grad="no grad"), _entry("v", grad="x")], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == ["'u' gradient: rank 0 grad, rank 1 no grad",
                                                          "'v' gradient: rank 0 grad, rank 1 x" + hint]


# ---- the settings reach the collectives: group=, tag names, a world of one --------------------------------------
def _problems_over_a_subgroup():
    from labutils.collectives import all_gather_variable_dim, all_to_all

    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return None
    bad = rank == 2
    return (caught(lambda: check_gather(torch.tensor(1.0) if bad else torch.ones(2), 0, None, sub, "g")),
            caught(lambda: all_gather_variable_dim(torch.ones(2), dim=3 if bad else 0, group=sub)),
            caught(lambda: all_to_all(torch.ones(2, 1), [1, 1], [2] if bad else [1, 1], sub)))


def test_a_ranks_own_problem_is_gathered_over_the_group_given():
    got = run_ranks(_problems_over_a_subgroup, 3)
    assert got[1] is None and got[0] == got[2]
    assert got[0] == (
        ("CollectiveMismatch", "g: rank 1 passed a 0-d tensor (a scalar); gather t.reshape(1) instead" + EVERY),
        ("IndexError", "all_gather_variable_dim: rank 1 passed dim=3, out of range for a tensor with ndim=1 (expected "
                       "-1..0)" + EVERY),
        ("CollectiveMismatch", "all_to_all: rank 1 split sizes need one entry per rank (world size 2); got 1 input "
                               "and 2 output entries" + EVERY))


def _one_rank():
    from labutils.collectives import all_gather_variable_dim

    t = torch.ones(2, 3)
    return (caught(lambda: all_gather_variable_dim(t, sizes=[2])[1].tolist()),
            caught(lambda: all_gather_variable_dim(t, sizes=[3])),
            caught(lambda: check_replicas(nn.Linear(1, 1), lambda p: ("dp", ""), {"dp": 0}, {}, None, "w", True)))


def test_a_world_of_one_rank():
    assert run_ranks(_one_rank, 1) == [(
        ("ok", [2]),
        ("CollectiveMismatch", "all_gather_variable_dim: rank 0 passed sizes=[3] but the ranks hold [2] along dim 0"
         + EVERY),
        ("ok", None))]
    assert _replica_problems([("", [_entry("a")], {"k": 1})], [0], "tag") == []


def _default_tag_name_and_two_problems():
    rank = dist.get_rank()
    spec = {"w": ((2,), F32, "dp" if rank == 0 else "expert")}
    tag_case = caught(lambda: check_replicas(Params(spec), _tag_of, {}, {}, None, "wrap", False))
    bad = {"a": ((1,), F32, "bad" if rank else "dp"), "b": ((1,), F32, "bad" if rank else "dp")}
    two = caught(lambda: check_replicas(Params(bad), _tag_of, {}, {}, None, "wrap", False))
    return tag_case, two


def test_the_default_tag_name_and_a_rank_with_two_problems():
    tag_case, two = alike(run_ranks(_default_tag_name_and_two_problems, 2))
    assert tag_case == ("CollectiveMismatch", "wrap: 'w' tag: rank 0 dp, rank 1 expert" + EVERY)
    assert two == ("CollectiveMismatch", "wrap: rank 1 parameter 'a': a bad tag; parameter 'b': a bad tag" + EVERY)


def _swapped_gradients():
    rank = dist.get_rank()
    spec = {"a": ((2,), F32, "dp"), "b": ((2,), F32, "dp")}           # same shapes: only the names tell them apart
    m = Params(spec, ("a",) if rank == 0 else ("b",))
    return caught(lambda: check_replicas(m, _tag_of, {"dp": 0}, {}, None, "wrap", True))


def test_gradients_on_different_parameters_of_the_same_shape_are_refused():
    hint = (" (the ranks that reduce a parameter must all have a gradient for it: use it in every rank's forward, or "
            "give it a zero gradient)")
    assert alike(run_ranks(_swapped_gradients, 2)) == (
        "CollectiveMismatch", "wrap: 'a' gradient: rank 0 grad, rank 1 no grad; 'b' gradient: rank 0 no grad, rank 1 "
                              "grad" + hint + EVERY)


def test_replica_problems_follow_rank_0s_order():
    gathered = [("", [_entry("a", (2,)), _entry("b", (2,))], {}), ("", [_entry("b", (3,)), _entry("a", (3,))], {})]
    assert _replica_problems(gathered, [0, 1], "tag") == ["'a' shape: rank 0 (2,), rank 1 (3,)",
                                                          "'b' shape: rank 0 (2,), rank 1 (3,)"]


def _count(monkeypatch):
    calls = []
    for name in ("all_gather", "all_gather_object", "all_reduce", "broadcast"):
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            if dist.get_rank() == 0:
                calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(dist, name, wrapper)
    return calls


def _agreeing(case):
    rank = dist.get_rank()
    if case == "replicas":
        m = Params({"w": ((2,), F32, "dp")}, ("w",))
        check_replicas(m, _tag_of, {"dp": 0}, {"k": 1}, None, "wrap", True)
    elif case == "fastmoe wrapper, dp groups":
        from labutils.data_parallel import DistributedGroupedDataParallel

        groups = [dist.new_group([0, 1]), dist.new_group([2])]
        m = nn.Linear(2, 1)
        ddp = DistributedGroupedDataParallel(m, dp_group=groups[rank // 2], need_sync=False)
        m(torch.ones(1, 2)).sum().backward()
        ddp.allreduce_gradients()
    elif case == "gather_rows":
        gather_rows([rank, 1], torch.zeros(1), None)


@pytest.mark.parametrize("case, want", [
    ("replicas", ["all_gather"]),                              # agreeing replicas: one gather of five int64
    # the dp tag's group starts at rank 0 on ranks 0, 1 and at rank 2 on rank 2: still one gather to agree
    ("fastmoe wrapper, dp groups", ["all_gather", "all_reduce"]),
    ("gather_rows", ["all_gather", "all_gather"]),             # the lengths, then the rows
])
def test_agreeing_ranks_pay_one_small_gather(monkeypatch, case, want):
    calls = _count(monkeypatch)
    run_ranks(_agreeing, 3, case)
    assert calls == want
