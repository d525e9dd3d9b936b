"""Chapter 04's exercise cases for the grader (:mod:`labbook.grader`): DeepSpeed's expert capacity as a
Transformer's MoE layer uses it, and the top-2 balancing loss ``l_aux``. Serves
notebooks/04_transformer_deepspeed.ipynb; red-teamed by tests/test_grader_ch04.py.

References are DeepSpeed 0.19.8's own code, called in the grading parent: ``sharded_moe._capacity`` (through
:func:`labbook.checkers.ch02.deepspeed_capacity`, with chapter 02's grid of float32 edge cases, so a capacity
rounded in float64 fails) and ``sharded_moe.top2gating`` with second-expert sampling off. The sandbox cannot import
DeepSpeed or labutils, and a pasted copy of the chapter's own ``l_aux_by_hand`` is refused by identity.
"""
from __future__ import annotations

import torch

from labbook.checkers import ch02
from labbook.grader.answers import Cases

# --- capacity -------------------------------------------------------------------------------------------------

CAPACITY_VISIBLE: tuple = ((256, 4, 2, 1.0), (256, 8, 1, 1.25), (10, 8, 2, 1.0), (300, 8, 3, 1.0), (100, 4, 1, 1.2, 0))


def deepspeed_capacity(tokens, num_experts, k, capacity_factor, min_capacity=4) -> int:
    """DeepSpeed's ``_capacity`` in this exercise's argument order (``min_capacity`` defaults to the gate's 4)."""
    return ch02.deepspeed_capacity(tokens, num_experts, capacity_factor, k, min_capacity)


def capacity_case(gen: torch.Generator, i: int) -> tuple:
    """Chapter 02's hidden capacity cases (float32 edge cases two in three), in this exercise's argument order."""
    s, e, cf, k, m = ch02.capacity_case(gen, i)
    return s, e, k, cf, m



# --- top-2 l_aux -------------------------------------------------------------------------------------------------

def deepspeed_top2_l_aux(logits):
    """``l_aux`` as DeepSpeed's ``top2gating`` returns it (second-expert sampling off; it adds noise in place
    otherwise, which does not change ``l_aux`` but would change the caller's logits)."""
    return ch02._sharded_moe().top2gating(logits.clone(), 1.0, 0, top2_2nd_expert_sampling=False)[0]


def _l_aux_visible() -> tuple:
    g = torch.Generator().manual_seed(4)
    return (ch02.router_logits(g, 64, 4, 2.0), ch02.router_logits(g, 256, 8, 2.0), ch02.router_logits(g, 10, 16, 2.0))


CASES = {
    "ds_capacity": lambda: Cases(deepspeed_capacity, CAPACITY_VISIBLE, capacity_case, n_hidden=12),
    "top2_l_aux": lambda: Cases(deepspeed_top2_l_aux, _l_aux_visible(), ch02.logits_case),
}
