"""Nested inputs: a tree (list, tuple, dict) of tensors routed together, as fastmoe's ``tree`` use. (Chapter 01.)

fastmoe runs ``tree.map_structure`` over its input so one gate decision moves several tensors (its MIMO
tests route ``{"x": x, "y": y}``). These three helpers are all the core needs: flatten to a list of leaves,
rebuild the same structure from new leaves, and map a function over the leaves.
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
