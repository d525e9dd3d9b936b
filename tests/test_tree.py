"""labutils.moe.tree: nested inputs (fastmoe's MIMO trees), each function against values written out by hand.
Mutation testing (make mutate, labutils/moe/tree.py) found these unpinned when only FMoE's own tests reached them."""
from __future__ import annotations

import collections

import pytest
import torch

from labutils.moe.tree import exchange_packed, tree_cat, tree_flatten, tree_map, tree_split, tree_unflatten

Pair = collections.namedtuple("Pair", "a b")


def _tree():
    """A dict holding a list, a namedtuple and a nested tuple: every kind of node, two levels deep."""
    t = [torch.full((3, 1), float(i)) for i in range(5)]
    return {"z": [t[0], (t[1], t[2])], "a": Pair(t[3], t[4])}, t


def test_flatten_orders_leaves_by_sorted_key_and_unflatten_rebuilds_every_node():
    tree, t = _tree()
    leaves, spec = tree_flatten(tree)
    assert [int(x[0, 0]) for x in leaves] == [3, 4, 0, 1, 2]           # "a" before "z", then depth first
    back = tree_unflatten([x + 10 for x in leaves], spec)
    assert set(back) == {"a", "z"} and isinstance(back["z"], list) and isinstance(back["z"][1], tuple)
    assert isinstance(back["a"], Pair)
    assert [int(back["a"].a[0, 0]), int(back["a"].b[0, 0])] == [13, 14]
    assert [int(back["z"][0][0, 0]), int(back["z"][1][0][0, 0]), int(back["z"][1][1][0, 0])] == [10, 11, 12]


def test_a_plain_tensor_is_its_own_tree():
    x = torch.ones(2, 3)
    leaves, spec = tree_flatten(x)
    assert spec is None and leaves[0] is x and tree_unflatten(leaves, spec) is x


def test_a_non_tensor_leaf_is_named_by_its_type():
    with pytest.raises(TypeError, match=r"^FMoE inputs are tensors or lists/tuples/dicts of tensors, got str$"):
        tree_flatten({"x": [torch.ones(1), "oops"]})


def test_map_split_and_cat():
    tree, _ = _tree()
    doubled = tree_map(lambda x: 2 * x, tree)
    assert int(doubled["a"].b[0, 0]) == 8 and isinstance(doubled["z"][1], tuple)
    rows = {"x": torch.arange(5.0).view(5, 1), "y": [torch.arange(10.0).view(5, 2)]}   # (5, 1), (5, 2)
    pieces = tree_split(rows, [2, 3])
    assert [p["x"].view(-1).tolist() for p in pieces] == [[0, 1], [2, 3, 4]]
    assert pieces[1]["y"][0].tolist() == [[4, 5], [6, 7], [8, 9]]
    back = tree_cat(pieces)
    assert torch.equal(back["x"], rows["x"]) and torch.equal(back["y"][0], rows["y"][0])
    # the structure comes from the first tree: a cat of namedtuple pieces stays a namedtuple
    assert isinstance(tree_cat([Pair(torch.ones(1), torch.ones(1)), Pair(torch.zeros(1), torch.zeros(1))]), Pair)


def test_exchange_packed_sends_one_tensor_and_unpacks_what_the_experts_return():
    """One (N, sum d) tensor crosses the 'wire'; the experts see the tree, return a tree of other widths, and the
    caller gets its leaves back in order. The exchange here is local: it runs the experts on what it is sent."""
    x = {"a": torch.arange(6.0).view(3, 2), "b": torch.arange(3.0).view(3, 1)}      # (3, 2), (3, 1)
    leaves, spec = tree_flatten(x)
    sent, seen = [], []

    def exchange(packed, run):
        sent.append(packed.clone())
        return run(packed, torch.tensor([3]))

    def experts(tree, counts):
        seen.append((tree, counts.tolist()))
        return [tree["b"] * 100, tree["a"].sum(-1, keepdim=True).repeat(1, 3)]       # widths 1 and 3

    out = exchange_packed(exchange, leaves, spec, experts)
    assert len(sent) == 1 and sent[0].tolist() == [[0, 1, 0], [2, 3, 1], [4, 5, 2]]
    tree, counts = seen[0]
    assert counts == [3] and torch.equal(tree["a"], x["a"]) and torch.equal(tree["b"], x["b"])
    assert [t.shape for t in out] == [(3, 1), (3, 3)]
    assert out[0].view(-1).tolist() == [0, 100, 200] and out[1].tolist() == [[1] * 3, [5] * 3, [9] * 3]


def test_exchange_packed_packs_along_the_last_dim_whatever_the_row_shape():
    """The packing is of the features, the LAST dim: rows that carry more dims, (N, S, d) leaves, are packed to
    (N, S, sum d) and cut back there, not along dim 1 (which for the (N, d) leaves of FMoE is the same dim)."""
    x = {"a": torch.arange(16.0).view(2, 4, 2), "b": -torch.arange(8.0).view(2, 4, 1)}     # S = 4, d = 2 and 1
    leaves, spec = tree_flatten(x)
    sent, seen = [], []

    def exchange(packed, run):
        sent.append(packed.clone())
        return run(packed, torch.tensor([2]))

    def experts(tree, counts):
        seen.append(tree)
        return [tree["b"] * 10, tree["a"].sum(-1, keepdim=True).repeat(1, 1, 3)]    # widths 1 and 3

    out = exchange_packed(exchange, leaves, spec, experts)
    assert len(sent) == 1 and torch.equal(sent[0], torch.cat([x["a"], x["b"]], -1))   # (2, 4, 3)
    assert torch.equal(seen[0]["a"], x["a"]) and torch.equal(seen[0]["b"], x["b"])
    assert [t.shape for t in out] == [(2, 4, 1), (2, 4, 3)]
    assert torch.equal(out[0], x["b"] * 10)
    assert out[1][1, 3].tolist() == [29.0] * 3                                         # 14 + 15


def test_tree_cat_of_one_tree_is_that_tree():
    """One expert, one piece (FMoE's expert_fn with num_expert=1 cats a list of one tree)."""
    a, b = torch.arange(3.0), torch.ones(2)
    back = tree_cat([Pair(a, b)])
    assert isinstance(back, Pair) and torch.equal(back.a, a) and torch.equal(back.b, b)


def test_unflatten_gives_each_of_three_siblings_its_own_leaf():
    t = [torch.full((1,), float(i)) for i in range(4)]
    leaves, spec = tree_flatten([t[0], t[1], (t[2],), t[3]])
    back = tree_unflatten([x * 2 for x in leaves], spec)
    assert [float(back[0]), float(back[1]), float(back[2][0]), float(back[3])] == [0.0, 2.0, 4.0, 6.0]
