"""Side-by-side speed of MoE MLP layers on one shape, forward + backward. (Taught in chapter 08.)

Rows (all fp32, top-k routing, the same ``T`` tokens, interleaved round by round so drifts hit all alike; each
round runs the rows in a fresh seeded order, because rows share one process's allocator: under glibc's defaults a
row that frees big buffers raises the heap thresholds for the row after it, so a fixed order would give each row
the same neighbour, and its page faults, in every round. ``faults MB`` is the memory faulted in per step):

* ``dense, same FLOPs``: one MLP with hidden ``top_k * h``: the experts' FLOPs, no routing (the reference);
* ``E MLPs, pre-sliced``: ``E`` separate MLPs on tokens already grouped by expert: routing-free experts;
* ``argsort + index_add``: the ~40-line layer people write first (nn.Linear experts, argsort, index_add);
* ``grouped_mm``: sorted rows through ``torch._grouped_mm`` with ``(E, h, d)`` weights (the ``grouped_mm`` design
  of :mod:`labbook.perf.dispatch`, :func:`~labbook.perf.dispatch.grouped_moe`, with its own gate and weights);
* ``naive loop``: per expert a boolean mask, its tokens, MLP, ``index_add`` (optional; the ``loop`` design,
  :func:`~labbook.perf.dispatch.loop_moe`);
* ``DeepSpeed cf=...``: ``deepspeed.moe.layer.MoE`` (drop_tokens) at the given capacity factors;
* ``ours`` and ``ours, again``: :class:`labutils.moe.FMoETransformerMLP` twice, two identical configurations
  whose difference is the repeat-to-repeat spread of this machine.

Statistics (:func:`row_stats`): per row the median and interquartile range of its times; ``paired`` is the
median over rounds of (reference time / row time) within the same round, the verdict statistic; ``share`` is
the fraction of the ``T*top_k`` choices a row computed (DeepSpeed drops the ones over capacity) and
``kept tok/s`` counts only those. The table and the verdicts read from it are :mod:`labbook.perf.verdicts`.
"""
from __future__ import annotations

import os
import platform
import random
import statistics

import torch
from torch import nn

from labutils.moe.gates import NaiveGate
from labutils.moe.transformer import FMoETransformerMLP

from .dispatch import grouped_moe, loop_moe
from .timing import clock, clock_name, quartiles
from .verdicts import format_table

REFERENCE = "dense, same FLOPs"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def mlp(d: int, h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))


class _Row:
    """A callable step (forward + backward) plus the share of choices it computed in its last call."""

    def __init__(self, name: str, module: nn.Module, step, share=lambda: 1.0):
        self.name, self.module, self.step, self.share = name, module, step, share
        self.times, self.faults = [], []

    def run(self) -> float:
        """One step with fresh gradients (``zero_grad(set_to_none=True)``, as a training loop); its time in
        seconds. The pages the step faulted in (first touch of memory new to the process) go to ``faults``."""
        for p in self.module.parameters():
            p.grad = None
        now = clock()
        f0 = minor_faults()
        t0 = now()
        self.step()
        elapsed = now() - t0
        self.faults.append(minor_faults() - f0)
        return elapsed


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def round_orders(num_rows: int, rounds: int, seed: int = 0) -> list:
    """One seeded random order of the rows per round: no row always runs after the same neighbour."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(num_rows))
        rng.shuffle(order)
        orders.append(order)
    return orders


def _fwd_bwd(module, x, grad):
    def step():
        module(x.detach().requires_grad_()).backward(grad)
    return step


# ---- the rows ----------------------------------------------------------------------------------------------
class SlicedMLPs(nn.Module):
    """``E`` MLPs on ``T*k`` rows already split into ``E`` equal groups: the experts without any routing."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.experts = nn.ModuleList([mlp(d, h) for _ in range(E)])
        self.k = k

    def forward(self, x):                                               # (T, d) -> (T*k, d)
        rows = x.repeat(self.k, 1)
        sizes = [len(c) for c in torch.arange(rows.shape[0]).chunk(len(self.experts))]
        return torch.cat([e(part) for e, part in zip(self.experts, rows.split(sizes))])


class ArgsortMoE(nn.Module):
    """The MoE layer people write first: gate, argsort by expert, one nn.Linear MLP per expert, index_add."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.gate = NaiveGate(d, E, 1, k)
        self.experts = nn.ModuleList([mlp(d, h) for _ in range(E)])
        self.k = k

    def forward(self, x):                                               # (T, d)
        idx, score = self.gate(x)                                       # (T, k), (T, k)
        order = torch.argsort(idx.reshape(-1), stable=True)             # (T*k,) choices sorted by expert
        counts = torch.bincount(idx.reshape(-1), minlength=len(self.experts)).tolist()
        token = order // self.k
        xs = x.index_select(0, token)                                   # (T*k, d)
        ys = torch.cat([e(part) for e, part in zip(self.experts, xs.split(counts))])
        ys = ys * score.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, token, ys)              # (T, d)


class GroupedMMMoE(nn.Module):
    """Sorted rows through ``torch._grouped_mm`` (one call per linear for all experts), weights ``(E, out, in)``:
    :func:`~labbook.perf.dispatch.grouped_moe` behind a :class:`~labutils.moe.NaiveGate`."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.gate = NaiveGate(d, E, 1, k)
        self.w1 = nn.Parameter(torch.randn(E, h, d) / d ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(E, h))
        self.w2 = nn.Parameter(torch.randn(E, d, h) / h ** 0.5)
        self.b2 = nn.Parameter(torch.zeros(E, d))

    def forward(self, x):                                               # (T, d)
        idx, score = self.gate(x)                                       # (T, k), (T, k)
        return grouped_moe(x, idx, score, self.w1, self.b1, self.w2, self.b2)


class NaiveLoopMoE(nn.Module):
    """The textbook MoE: for each expert, find its tokens with a mask, run it, add the weighted output
    (:func:`~labbook.perf.dispatch.loop_moe` behind a :class:`~labutils.moe.NaiveGate`, nn.Linear experts)."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.gate = NaiveGate(d, E, 1, k)
        self.experts = nn.ModuleList([mlp(d, h) for _ in range(E)])

    def forward(self, x):                                               # (T, d)
        idx, score = self.gate(x)                                       # (T, k), (T, k)
        weights = [tuple(e.parameters()) for e in self.experts]         # (w1, b1, w2, b2) of each expert's MLP
        return loop_moe(x, idx, score, weights)


def _ours_row(x, grad, d, h, k, E, name="ours (FMoETransformerMLP)"):
    layer = FMoETransformerMLP(E, d, h, top_k=k, init="linear")
    seen = {}
    layer.gate_hook = lambda idx, score, _: seen.update(share=(idx >= 0).float().mean().item())
    return _Row(name, layer, _fwd_bwd(layer, x, grad), lambda: seen.get("share", float("nan")))


def _deepspeed_rows(x, grad, d, h, k, E, factors):
    from labutils.ds.runtime import init_deepspeed
    from labutils.nbtools import quiet
    init_deepspeed()
    from deepspeed.moe.layer import MoE
    rows = []
    for cf in factors:
        with quiet():  # "No existing process group found, creating a new group named: ep_size_1"
            moe = MoE(hidden_size=d, expert=mlp(d, h), num_experts=E, k=k, capacity_factor=cf,
                      eval_capacity_factor=cf, min_capacity=4, drop_tokens=True)
            moe.set_deepspeed_parallelism()
        seen = {}
        moe.deepspeed_moe.gate.register_forward_hook(lambda m, i, out, seen=seen: seen.update(share=_ds_share(out, k)))

        def step(moe=moe):
            out, _l_aux, _counts = moe(x.detach().requires_grad_())
            out.backward(grad)
        rows.append(_Row(f"DeepSpeed cf={cf:g}", moe, step, lambda seen=seen: seen.get("share", float("nan"))))
    return rows


def _ds_share(gate_out, k) -> float:
    """Kept share from DeepSpeed's gate output: sparse routes (indices -1 = dropped) or a dense dispatch mask."""
    if len(gate_out) == 7:                        # (l_aux, C, E, indices (k, S), locations, gates, exp_counts)
        indices = gate_out[3]
        return (indices >= 0).float().mean().item()
    dispatch = gate_out[2]                        # (S, E, C) bool
    return dispatch.sum().item() / (dispatch.shape[0] * k)


def build_rows(T, d, h, E, top_k=2, deepspeed_factors=(1.0,), naive=False, seed=0, only: str | None = None) -> list:
    """Every row of the table on one shape, built from the same seeded input and output gradient.
    ``only``: build just the rows whose name starts with it (a memory measurement must not hold the others)."""
    torch.manual_seed(seed)
    x, grad = torch.randn(T, d), torch.randn(T, d)

    def plain(name, make, g=grad):
        return lambda: [_Row(name, layer := make(), _fwd_bwd(layer, x, g))]

    makers = [(REFERENCE, plain(REFERENCE, lambda: mlp(d, top_k * h))),
              ("E MLPs, pre-sliced", plain("E MLPs, pre-sliced", lambda: SlicedMLPs(d, h, E, top_k),
                                           grad.repeat(top_k, 1))),
              ("argsort + index_add", plain("argsort + index_add", lambda: ArgsortMoE(d, h, E, top_k))),
              ("grouped_mm, sorted rows", plain("grouped_mm, sorted rows", lambda: GroupedMMMoE(d, h, E, top_k)))]
    if naive:
        makers.append(("naive loop", plain("naive loop", lambda: NaiveLoopMoE(d, h, E, top_k))))
    if deepspeed_factors:
        makers.append(("DeepSpeed", lambda: _deepspeed_rows(x, grad, d, h, top_k, E, deepspeed_factors)))
    makers += [("ours (", lambda: [_ours_row(x, grad, d, h, top_k, E)]),
               ("ours, again", lambda: [_ours_row(x, grad, d, h, top_k, E, "ours, again")])]
    rows = []
    for i, (name, make) in enumerate(makers):
        if only is None or name.startswith(only) or only.startswith(name):
            torch.manual_seed(seed + i + 1)  # each layer's weights: the same whichever rows are built
            rows += make()
    if only is not None:
        rows = [r for r in rows if r.name.startswith(only)]
        if not rows:
            raise ValueError(f"no row starts with {only!r}")
    return rows


# ---- statistics ----------------------------------------------------------------------------------------------
def row_stats(times: list, reference: list, share: float, tokens: int, faults: list | None = None) -> dict:
    """Median and IQR of one row's times, and its paired ratio to the reference (median and IQR over rounds);
    ``faults``: pages faulted in per step (reported as the median MB per step)."""
    q1, med, q3 = quartiles(times)
    ratios = [r / t for r, t in zip(reference, times)]
    p1, pmed, p3 = quartiles(ratios)
    fault_mb = statistics.median(faults) * PAGE_BYTES / 2 ** 20 if faults else None
    return dict(median_ms=1e3 * med, iqr_pct=100 * (q3 - q1) / med, best_ms=1e3 * min(times),
                share=share, tokens_per_s=tokens / med, kept_tokens_per_s=share * tokens / med,
                ratio_paired_median=pmed, ratio_paired_iqr=(p1, p3), times_ms=[1e3 * t for t in times],
                faults_mb_per_step=fault_mb)


def bench_shape(T: int, d: int, h: int, E: int, top_k: int = 2, repeats: int = 5, deepspeed_factors=(1.0,),
                naive: bool = False, seed: int = 0, verbose: bool = True) -> dict:
    """Time every row on one shape, interleaved in a seeded random order per round (:func:`round_orders`);
    returns ``{"shape", "rows": [...]}`` with :func:`row_stats`."""
    rows = build_rows(T, d, h, E, top_k, deepspeed_factors, naive, seed)
    for row in rows:  # warm-up (allocator, first-call costs)
        row.run()
        row.faults.clear()
    orders = round_orders(len(rows), repeats, seed)
    for order in orders:
        for i in order:
            rows[i].times.append(rows[i].run())
    out = [dict(row=row.name, **row_stats(row.times, rows[0].times, row.share(), T, row.faults)) for row in rows]
    result = dict(shape=dict(T=T, d=d, h=h, E=E, top_k=top_k), repeats=repeats, threads=torch.get_num_threads(),
                  clock=clock_name(), order="seeded random order per round", rows=out)
    if verbose:
        print(format_table(result))
    return result


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (``mallopt``), as jemalloc/tcmalloc do.

    A tuning a notebook user does not have: benchmarks measure glibc's defaults first and may add a row with
    this, labelled. Returns False where glibc is not available.
    """
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not name or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False

