"""Nested inputs: a tree (list, tuple, dict) of tensors routed together, as fastmoe's ``tree`` use. (Chapter 01.)

fastmoe runs ``tree.map_structure`` over its input so one gate decision moves several tensors (its MIMO
tests route ``{"x": x, "y": y}``). ``FMoE`` works on the list of leaves and rebuilds the structure only where a
gate or an expert sees it; a plain tensor input never comes here. Flatten to a list of leaves, rebuild the same
structure from new leaves, map a function over the leaves; split a tree's rows per expert and concatenate them
back; send a tree across ranks as one tensor.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``(leaves, spec)``: the tensors of ``tree`` in a fixed order (dict keys sorted) and its structure."""
    if isinstance(tree, dict):
        keys = sorted(tree)
        parts = [tree_flatten(tree[k]) for k in keys]
        return [leaf for p in parts for leaf in p[0]], ("dict", keys, [p[1] for p in parts])
    if isinstance(tree, (list, tuple)):
        parts = [tree_flatten(t) for t in tree]
        return [leaf for p in parts for leaf in p[0]], (type(tree), None, [p[1] for p in parts])
    if not torch.is_tensor(tree):
        raise TypeError(f"FMoE inputs are tensors or lists/tuples/dicts of tensors, got {type(tree).__name__}")
    return [tree], None


def _count(spec: Any) -> int:
    return 1 if spec is None else sum(_count(s) for s in spec[2])


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    if spec is None:
        return leaves[0]
    kind, keys, children = spec
    out, at = [], 0
    for child in children:
        n = _count(child)
        out.append(tree_unflatten(leaves[at:at + n], child))
        at += n
    if kind == "dict":
        return dict(zip(keys, out))
    return kind(*out) if hasattr(kind, "_fields") else kind(out)    # a namedtuple takes its fields as args


def tree_map(fn: Callable, tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(t) for t in leaves], spec)


def tree_split(tree: Any, sizes: list) -> list:
    """``tree`` cut along dim 0 into pieces of ``sizes`` rows: one tree of the same structure per piece."""
    leaves, spec = tree_flatten(tree)
    return [tree_unflatten(list(piece), spec) for piece in zip(*[t.split(sizes) for t in leaves])]


def tree_cat(trees: list) -> Any:
    """Inverse of :func:`tree_split`: trees of one structure -> one tree, each leaf concatenated along dim 0."""
    flat = [tree_flatten(t) for t in trees]
    return tree_unflatten([torch.cat(col) for col in zip(*[leaves for leaves, _ in flat])], flat[0][1])


def exchange_packed(exchange: Callable, leaves: list, spec: Any, run_experts: Callable) -> list:
    """A tree crosses the wire as ONE ``(N, sum d)`` tensor: one exchange instead of one per leaf.

    ``exchange(x, run)`` moves the packed rows to the experts' ranks, calls ``run(x_local, counts)`` there and
    brings the result back (``expert_parallel.exchange_and_run``); ``run`` unpacks the rows into the tree
    ``spec`` for ``run_experts`` and packs what it returns. Returns the leaves of the experts' output.
    """
    widths, out_widths = [t.shape[-1] for t in leaves], []

    def run(x, counts):
        y = tree_flatten(run_experts(tree_unflatten(list(x.split(widths, -1)), spec), counts))[0]
        out_widths[:] = [t.shape[-1] for t in y]
        return torch.cat(y, -1)

    y = exchange(torch.cat(leaves, -1), run)                                 # (N, sum d_out)
    return list(y.split(out_widths, -1))
