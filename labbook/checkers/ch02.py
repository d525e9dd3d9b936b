"""Chapter 02's exercise cases for the grader (:mod:`labbook.grader`): DeepSpeed's expert capacity, the top-1
``l_aux``, and the ``[E, C, d]`` dispatch buffer. Serves notebooks/02_deepspeed_moe.ipynb (chapters 04 and 06 reuse
the capacity cases); red-teamed by tests/test_grader_ch02.py.

Every reference is DeepSpeed 0.19.8's own code, called in the grading parent: ``sharded_moe._capacity`` (the function
every ``TopKGate`` calls), ``sharded_moe.top1gating``, and the buffer a real ``deepspeed.moe.layer.MoE`` hands its
experts (recorded by a forward pre-hook). Never the lab's ``labutils.ds.gating`` re-derivation, which the exercises
re-implement; the sandbox cannot import DeepSpeed or labutils at all.

The capacity's hidden cases come from a fixed grid scanned once per process: the float32 edge cases, where
DeepSpeed's ``ceil((S / E) * float32(cf * k))`` differs from the same formula in float64 or in exact arithmetic
(e.g. S=100, E=4, cf=1.2, k=1: DeepSpeed 31, float64 30), are drawn in two of every three hidden cases, each
confirmed with ``_capacity``, so a
float64 or exact-fraction answer fails and only DeepSpeed's float32 arithmetic passes.
"""
from __future__ import annotations

import functools
import math

import torch

from labbook.grader.answers import Cases

# the capacity grid: tokens, experts, capacity factor (in hundredths), k
GRID_TOKENS = (2, 513)            # range(*GRID_TOKENS)
GRID_EXPERTS = (2, 17)
GRID_CF_HUNDREDTHS = (5, 305, 5)  # capacity factors 0.05 .. 3.00
GRID_K = (1, 2, 3)


def _sharded_moe():
    """DeepSpeed's ``sharded_moe`` module (imported quietly, CPU accelerator)."""
    from labutils.ds.runtime import import_deepspeed

    import_deepspeed()
    from deepspeed.moe import sharded_moe

    return sharded_moe


# --- capacity -------------------------------------------------------------------------------------------------

def deepspeed_capacity(tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """DeepSpeed's own ``_capacity``, called as ``TopKGate`` calls it: ``torch.tensor(capacity_factor * k)``.
    It reads only the shape of the gates, so a meta tensor of shape ``(tokens, num_experts)`` stands in."""
    sm = _sharded_moe()
    gates = torch.empty(tokens, num_experts, device="meta")                  # (S, E): only the shape is read
    return int(sm._capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity)))


@functools.lru_cache(maxsize=1)
def capacity_edge_candidates() -> tuple:
    """``(float64_edges, exact_edges)``: grid cases ``(S, E, cf, k)`` where DeepSpeed's float32 arithmetic
    ``ceil(float32(S / E) * float32(cf * k))``, emulated over the whole grid (about 1.4 million cases at once),
    differs from ``ceil(S / E * cf * k)`` in float64, and where it differs from the exact ceil (cf read as
    hundredths). Candidates only: :func:`capacity_case` confirms each one it draws with DeepSpeed's ``_capacity``."""
    S = torch.arange(*GRID_TOKENS, dtype=torch.float64)[:, None, None, None]
    E = torch.arange(*GRID_EXPERTS, dtype=torch.float64)[None, :, None, None]
    c = torch.arange(*GRID_CF_HUNDREDTHS, dtype=torch.float64)[None, None, :, None]
    k = torch.tensor(GRID_K, dtype=torch.float64)[None, None, None, :]
    f64 = torch.ceil(S / E * (c / 100) * k)                                 # float64, tokens / E * cf * k
    f32 = torch.ceil((S / E).float() * ((c / 100) * k).float()).double()    # DeepSpeed's arithmetic
    num, den = S * c * k, E * 100                                           # exact: ceil(num / den)
    exact = torch.div(num + den - 1, den, rounding_mode="floor")

    def cases(mask):
        at = mask.nonzero()                                                  # (n, 4) grid indices
        cols = (S.flatten()[at[:, 0]].long().tolist(), E.flatten()[at[:, 1]].long().tolist(),
                (c.flatten()[at[:, 2]] / 100).tolist(), k.flatten()[at[:, 3]].long().tolist())
        return tuple(zip(*cols))

    return cases(f32 != f64), cases(f32 != exact)


def capacity_case(gen: torch.Generator, i: int) -> tuple:
    """The i-th hidden capacity case ``(S, E, cf, k, min_capacity)``: a float64 edge case (i % 3 == 0), an
    exact-arithmetic edge case (i % 3 == 1), each confirmed with DeepSpeed's ``_capacity`` (a candidate it does not
    confirm is drawn again), or any grid case with a random ``min_capacity`` (i % 3 == 2)."""
    def pick(n):
        return int(torch.randint(0, n, (), generator=gen))

    if i % 3 < 2:
        f64_edges, exact_edges = capacity_edge_candidates()
        edges = f64_edges if i % 3 == 0 else exact_edges
        for _ in range(100):
            s, e, cf, k = edges[pick(len(edges))]
            exact = -(-(s * round(cf * 100) * k) // (e * 100))                  # ceil of the exact fraction
            if deepspeed_capacity(s, e, cf, k, 0) != (math.ceil(s / e * cf * k) if i % 3 == 0 else exact):
                return s, e, cf, k, 0
        raise RuntimeError("capacity_case: DeepSpeed's _capacity confirmed none of 100 float32 edge candidates")
    s, e = GRID_TOKENS[0] + pick(GRID_TOKENS[1] - GRID_TOKENS[0]), GRID_EXPERTS[0] + pick(GRID_EXPERTS[1] - 2)
    cf = (GRID_CF_HUNDREDTHS[0] + 5 * pick(60)) / 100
    return s, e, cf, GRID_K[pick(len(GRID_K))], (0, 4, 8, 64)[pick(4)]


CAPACITY_VISIBLE = ((64, 4, 1.0, 1, 4), (100, 4, 1.2, 1, 0), (3, 4, 1.0, 2, 4), (1000, 8, 0.3, 2, 0),
                    (128, 6, 1.25, 2, 8))



# --- top-1 l_aux ------------------------------------------------------------------------------------------------

def router_logits(gen: torch.Generator, tokens: int, experts: int, scale: float, favourite: float = 0.0):
    """``(tokens, experts)`` float32 logits on a 2^-12 grid (no two logits of a token closer than that, so the
    argmax of the logits and of their float32 softmax agree), ``favourite`` added to expert 0's logit."""
    z = torch.randn(tokens, experts, generator=gen) * scale
    z[:, 0] += favourite
    return torch.round(z * 4096) / 4096                                       # (S, E)


def deepspeed_top1_l_aux(logits):
    """``l_aux`` as DeepSpeed's ``top1gating`` returns it (capacity factor 1, no random token selection)."""
    return _sharded_moe().top1gating(logits.clone(), 1.0, 0, use_rts=False)[0]


def _l_aux_visible() -> tuple:
    g = torch.Generator().manual_seed(5)
    return (router_logits(g, 64, 4, 1.0), router_logits(g, 32, 8, 3.0), router_logits(g, 16, 2, 1.0))


def logits_case(gen: torch.Generator, i: int) -> torch.Tensor:
    """Random logits: 1 to 300 tokens, 2 to 16 experts, scales from flat to peaked; every fourth case has a
    router leaning towards expert 0 (a collapsing router, l_aux towards E)."""
    tokens = int(torch.randint(1, 301, (), generator=gen))
    experts = int(torch.randint(2, 17, (), generator=gen))
    scale = (0.3, 1.0, 3.0, 8.0)[int(torch.randint(0, 4, (), generator=gen))]
    return router_logits(gen, tokens, experts, scale, favourite=3.0 * scale if i % 4 == 3 else 0.0)



# --- the [E, C, d] dispatch buffer -------------------------------------------------------------------------------

DISPATCH_VISIBLE = ((0, 24, 16, 4, 1, 1.0), (1, 24, 16, 4, 1, 0.5), (2, 24, 16, 4, 2, 0.75), (3, 24, 16, 4, 2, 2.0))


def real_dispatch(seed: int, tokens: int, d: int, experts: int, k: int, cf: float) -> tuple:
    """A real ``MoE`` layer (seeded router, sampling off) and seeded tokens. Returns the case
    ``(x (S, d), indices (k, S), locations (k, S), E, C)`` (the gate's sparse routes, int64, -1 = dropped) and the
    layer, whose experts' input :func:`experts_input` records."""
    from labutils.ds.runtime import init_deepspeed
    from labutils.nbtools import quiet

    init_deepspeed()
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)
    with quiet():
        layer = MoE(d, torch.nn.Linear(d, d), num_experts=experts, k=k, capacity_factor=cf, min_capacity=0,
                    use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(tokens, d)                                                # (S, d)
    with torch.no_grad():
        _, capacity, n_exp, indices, locations, _, _ = layer.deepspeed_moe.gate(x, None, True)
    return (x, indices.long(), locations.long(), int(n_exp), int(capacity)), layer


def experts_input(layer, x: torch.Tensor) -> torch.Tensor:
    """Run ``layer`` on ``x`` and return the ``(E, C, d)`` buffer its experts received (a forward pre-hook)."""
    seen = []
    hook = layer.deepspeed_moe.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].detach()))
    try:
        with torch.no_grad():
            layer(x)
    finally:
        hook.remove()
    return seen[0]                                                            # (E, C, d)


def dispatch_case(gen: torch.Generator, i: int) -> tuple:
    """Hidden dispatch settings ``(seed, S, d, E, k, cf)``; even cases have capacity factor 0.5 (many drops)."""
    def pick(options):
        return options[int(torch.randint(0, len(options), (), generator=gen))]

    cf = 0.5 if i % 2 == 0 else pick((0.75, 1.0, 1.5))
    return (int(torch.randint(0, 2**31, (), generator=gen)), pick((8, 13, 24, 40)), pick((4, 8, 16)),
            pick((2, 3, 4, 8)), pick((1, 2)), cf)


def dispatch_cases() -> Cases:
    """The dispatch exercise's cases: each case's real ``MoE`` layer is kept here, by the identity of its ``x``; the
    buffer its experts receive is recorded only when the reference runs (in the grading parent)."""
    layers = {}                                                               # id(x) -> its real MoE layer

    def build(settings):
        case, layer = real_dispatch(*settings)
        layers[id(case[0])] = layer
        return case

    return Cases(lambda x, *rest: experts_input(layers[id(x)], x), [build(s) for s in DISPATCH_VISIBLE],
                 lambda gen, i: build(dispatch_case(gen, i)), n_hidden=6)


CASES = {
    "my_capacity": lambda: Cases(deepspeed_capacity, CAPACITY_VISIBLE, capacity_case, n_hidden=12),
    "my_top1_l_aux": lambda: Cases(deepspeed_top1_l_aux, _l_aux_visible(), logits_case),
    "my_dispatch": dispatch_cases,
}
