"""Chapter 04's exercise cases for the grader (:mod:`labbook.grader`): DeepSpeed's expert capacity as a
Transformer's MoE layer uses it, and the top-2 balancing loss ``l_aux`` of one optimiser step run as micro-batches.
Serves notebooks/04_transformer_deepspeed.ipynb; red-teamed by tests/test_grader_ch04.py.

References are DeepSpeed 0.19.8's own code, called in the grading parent: ``sharded_moe._capacity`` (through
:func:`labbook.checkers.ch02.deepspeed_capacity`, with chapter 02's grid of float32 edge cases, so a capacity
rounded in float64 fails), and a real ``deepspeed.moe.layer.MoE`` (k = 2) run on each micro-batch of a step, whose
returned ``l_aux`` values are combined as ``DeepSpeedEngine.backward`` combines the micro-batches' losses (each
divided by ``gradient_accumulation_steps``, the gradients added: the step follows their mean). The sandbox cannot
import DeepSpeed or labutils, and a pasted copy of the chapter's own ``l_aux_by_hand`` is refused by identity.
"""
from __future__ import annotations

import functools

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


# --- top-2 l_aux of one optimiser step, run as micro-batches --------------------------------------------------------

def step_inputs(gen: torch.Generator, batch: int, seq: int, d: int, experts: int, lean: float = 0.0) -> tuple:
    """``(x (batch, seq, d), router_weight (experts, d))`` on grids that make every logit ``x · W`` exact in float32
    however it is summed (x on a 2^-8 grid within [-4, 4], W on a 2^-8 grid within [-2, 2], d <= 16: every partial
    sum is a multiple of 2^-16 below 2^8), so ``x @ W.T``, ``F.linear`` and DeepSpeed's gate agree on every first
    choice. ``lean`` > 0 gives the tokens a common direction and tilts expert 0's row towards it (a router leaning on
    expert 0, l_aux towards E)."""
    if d > 16:
        raise ValueError(f"d = {d}: the logits are exact in float32 only for d <= 16")
    grid = lambda t, bound: (t.clamp(-bound, bound) * 256).round() / 256
    common = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1            # a direction every token shares
    x = grid(torch.randn(batch, seq, d, generator=gen) + (common if lean else 0.0), 4.0)
    w = torch.randn(experts, d, generator=gen) * 0.5
    w[0] += lean * common / d
    return x, grid(w, 2.0)


@functools.lru_cache(maxsize=None)
def _moe_layer(d: int, experts: int):
    """A real DeepSpeed ``MoE`` layer, k = 2 (its router weight is overwritten per case; only its ``l_aux`` is read)."""
    from labutils.ds import init_deepspeed
    from labutils.nbtools import quiet

    init_deepspeed()
    from deepspeed.moe.layer import MoE

    with quiet():
        return MoE(d, torch.nn.Linear(d, d), num_experts=experts, k=2, min_capacity=0,
                   top2_2nd_expert_sampling=False)


def deepspeed_step_l_aux(x, router_weight, micro_batches):
    """The ``l_aux`` one optimiser step follows: DeepSpeed's ``MoE`` called once per micro-batch ``(b, T, d)`` (it
    flattens the micro-batch into ``b·T`` tokens for one gate call), each value divided by the number of micro-batches
    and added up, as ``engine.backward`` scales each micro-batch's loss before its gradient accumulates."""
    layer = _moe_layer(x.shape[-1], router_weight.shape[0])
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(router_weight)  # pyright: ignore[reportCallIssue, reportAttributeAccessIssue]
        per_call = [layer(xb)[1] for xb in x.chunk(micro_batches)]             # one gate call per micro-batch
    return torch.stack(per_call).sum() / micro_batches


def _step_visible() -> tuple:
    g = torch.Generator().manual_seed(4)
    return ((*step_inputs(g, 4, 8, 16, 4), 1),                 # the whole step in one call
            (*step_inputs(g, 8, 4, 16, 4), 4),                 # four calls of 2 sequences
            (*step_inputs(g, 6, 5, 8, 8, lean=3.0), 3),        # a router leaning on expert 0, three calls
            (*step_inputs(g, 4, 6, 12, 6), 4))                 # one sequence per call


def step_case(gen: torch.Generator, i: int) -> tuple:
    """Hidden cases: 2 to 12 sequences of 2 to 10 positions, d in 4..16, E in 2..16; the micro-batches a divisor of the
    batch other than 1 and the batch itself (so neither the whole batch at once nor one sequence per call is right by
    accident), except every fifth case (one call, or one sequence per call); every third router leans on expert 0."""
    def pick(options):
        return options[int(torch.randint(0, len(options), (), generator=gen))]

    batch = pick((4, 6, 8, 12)) if i % 5 != 4 else pick((2, 3, 4))
    between = [g for g in range(2, batch) if batch % g == 0]
    micro = pick(between) if i % 5 != 4 else pick((1, batch))
    x, w = step_inputs(gen, batch, pick(range(2, 11)), pick((4, 8, 12, 16)), pick(range(2, 17)),
                       lean=3.0 if i % 3 == 2 else 0.0)
    return x, w, micro


CASES = {
    "ds_capacity": lambda: Cases(deepspeed_capacity, CAPACITY_VISIBLE, capacity_case, n_hidden=12),
    "top2_l_aux": lambda: Cases(deepspeed_step_l_aux, _step_visible(), step_case, n_hidden=10),
}
