"""Chapter 06's exercise cases for the grader (:mod:`labbook.grader`): the backward of an all-gather, the local order
of received rows, and the bytes of DeepSpeed's dispatch all-to-all. Serves notebooks/06_distributed_experts.ipynb;
red-teamed by tests/test_grader_ch06.py.

References are independent of the functions the exercises re-implement: single-process autograd through
``torch.cat`` (the all-gather's backward), a brute-force loop over the received blocks (the local order), and
DeepSpeed 0.19.8's own ``sharded_moe._capacity`` (through :func:`labbook.checkers.ch02.deepspeed_capacity`,
with chapter 02's grid of float32 edge cases, so a capacity rounded in float64, or by ``int()``/``round()``, fails).
All three run in the grading parent; the sandbox cannot import labutils or DeepSpeed.
"""
from __future__ import annotations

import torch

from labbook.checkers import ch02
from labbook.grader.answers import Cases

# --- exercise 1: the backward of an all-gather -------------------------------------------------------------------


def all_gather_backward_reference(upstream, sizes, rank, mode):
    """Autograd on one process: the gathered tensor is ``torch.cat`` of every rank's input; rank ``s``'s loss is
    ``(upstream[s] * gathered).sum()``. ``mode="sum"``: every rank's loss reaches ``x_rank``; ``"slice"``: only
    its own (the computation after the gather is replicated, each rank holds the whole gradient)."""
    xs = [torch.zeros(n, upstream[0].shape[1], dtype=upstream[0].dtype, requires_grad=True) for n in sizes]
    gathered = torch.cat(xs)                                                   # (sum(sizes), d)
    used = upstream if mode == "sum" else [upstream[rank]]
    torch.stack([(g * gathered).sum() for g in used]).sum().backward()
    return xs[rank].grad


def _gather_case(gen: torch.Generator, sizes, rank: int, mode: str, d: int) -> tuple:
    upstream = [torch.randn(sum(sizes), d, generator=gen, dtype=torch.double) for _ in sizes]
    return upstream, list(sizes), rank, mode


def _gather_visible() -> tuple:
    gen = torch.Generator().manual_seed(6)
    return tuple(_gather_case(gen, sizes, rank, mode, 4) for sizes in ([2, 3], [2, 0, 3], [1, 4, 2, 2])
                 for rank in (0, len(sizes) - 1) for mode in ("slice", "sum"))


def gather_case(gen: torch.Generator, i: int) -> tuple:
    """The i-th hidden case: 1-5 ranks holding 0-4 rows each (a rank with none every so often), any rank, the
    two modes in turn."""
    world = 1 + int(torch.randint(0, 5, (), generator=gen))
    sizes = torch.randint(0, 5, (world,), generator=gen).tolist()
    rank = int(torch.randint(0, world, (), generator=gen))
    d = 1 + int(torch.randint(0, 5, (), generator=gen))
    return _gather_case(gen, sizes, rank, ("sum", "slice")[i % 2], d)



# --- exercise 2: the local order -----------------------------------------------------------------------------------

LOCAL_ORDER_VISIBLE = (([2, 1, 0, 3, 1, 1], 2), ([0, 0, 0, 0], 2), ([3, 1, 4, 1, 5, 9, 2, 6], 4), ([2, 0, 1], 1),
                       ([1, 2, 3, 0, 0, 4, 5, 1, 1], 3))


def local_order_reference(global_expert_count, num_expert):
    """A loop: for each local expert, for each source rank, that block's rows in arrival order."""
    counts = [int(c) for c in global_expert_count.tolist()]
    starts = [sum(counts[:b]) for b in range(len(counts))]                    # first row of each received block
    world = len(counts) // num_expert
    return torch.tensor([starts[s * num_expert + e] + j for e in range(num_expert) for s in range(world)
                         for j in range(counts[s * num_expert + e])], dtype=torch.long)


def local_order_case(gen: torch.Generator, i: int) -> tuple:
    """The i-th hidden case: 1-6 source ranks, 1-4 local experts, 0-5 rows per block (many empty blocks)."""
    world = 1 + int(torch.randint(0, 6, (), generator=gen))
    ne = 1 + int(torch.randint(0, 4, (), generator=gen))
    counts = (torch.randint(0, 6, (world * ne,), generator=gen) - 1).clamp_min(0)
    return counts, ne



# --- exercise 3: DeepSpeed's dispatch bytes ----------------------------------------------------------------------

# (tokens, E, W, d, elem, cf, k); 25 tokens over 2 experts at cf 1.2: float32 gives C = 16, float64 15;
# 50 / 8 * 1.0 = 6.25: ceil 7, int() and round() 6
DISPATCH_BYTES_VISIBLE = ((48, 16, 8, 16, 4, 1.0, 2), (4096, 64, 8, 1024, 2, 1.25, 1), (3, 8, 2, 8, 4, 1.0, 1),
                          (25, 2, 2, 8, 4, 1.2, 1), (50, 8, 4, 16, 4, 1.0, 1), (100, 4, 2, 8, 2, 1.2, 1))
MIN_CAPACITY = 4


def deepspeed_dispatch_bytes(tokens, E, W, d, elem, cf, k) -> int:
    """Bytes one rank sends to other ranks: its ``(E, C, d)`` buffer minus the ``E/W`` experts that stay local,
    with ``C`` from DeepSpeed's ``_capacity`` (minimum capacity 4)."""
    capacity = ch02.deepspeed_capacity(tokens, E, cf, k, MIN_CAPACITY)
    return E * capacity * d * elem * (W - 1) // W


def dispatch_bytes_case(gen: torch.Generator, i: int) -> tuple:
    """Chapter 02's hidden capacity cases (float32 edge cases two in three), with a world size of at least 2 (one
    rank sends nothing, whatever the capacity) that divides E, a width and an element size."""
    s, e, cf, k, _ = ch02.capacity_case(gen, i)
    divisors = [w for w in range(2, e + 1) if e % w == 0]
    w = divisors[int(torch.randint(0, len(divisors), (), generator=gen))]
    d = 1 + int(torch.randint(0, 64, (), generator=gen))
    return s, e, w, d, (2, 4)[int(torch.randint(0, 2, (), generator=gen))], cf, k


CASES = {
    "all_gather_backward": lambda: Cases(all_gather_backward_reference, _gather_visible(), gather_case, n_hidden=10,
                                         rtol=1e-12, atol=1e-12),
    "my_local_order": lambda: Cases(local_order_reference, [(torch.tensor(c), ne) for c, ne in LOCAL_ORDER_VISIBLE],
                                    local_order_case, n_hidden=10),
    "ds_dispatch_bytes": lambda: Cases(deepspeed_dispatch_bytes, DISPATCH_BYTES_VISIBLE, dispatch_bytes_case,
                                       n_hidden=12),
}
