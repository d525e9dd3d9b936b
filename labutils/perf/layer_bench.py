"""Side-by-side speed of MoE MLP layers on one shape, forward + backward. (Taught in chapter 08.)

Rows (all fp32, top-k routing, the same ``T`` tokens, interleaved round by round so drifts hit all alike; each
round runs the rows in a fresh seeded order, because rows share one process's allocator: under glibc's defaults a
row that frees big buffers raises the heap thresholds for the row after it, so a fixed order would give each row
the same neighbour, and its page faults, in every round. ``faults MB`` is the memory faulted in per step):

* ``dense, same FLOPs``: one MLP with hidden ``top_k * h``: the experts' FLOPs, no routing (the reference);
* ``E MLPs, pre-sliced``: ``E`` separate MLPs on tokens already grouped by expert: routing-free experts;
* ``argsort + index_add``: the ~40-line layer people write first (nn.Linear experts, argsort, index_add);
* ``grouped_mm``: sorted rows through ``torch._grouped_mm`` with ``(E, h, d)`` weights;
* ``naive loop``: per expert a boolean mask, ``index_select``, MLP, ``index_add`` (optional);
* ``DeepSpeed cf=...``: ``deepspeed.moe.layer.MoE`` (drop_tokens) at the given capacity factors;
* ``ours`` and ``ours, again``: :class:`labutils.moe.FMoETransformerMLP` twice, two identical configurations
  whose difference is the repeat-to-repeat spread of this machine.

Statistics (:func:`row_stats`): per row the median and interquartile range of its times; ``paired`` is the
median over rounds of (reference time / row time) within the same round, the verdict statistic; ``share`` is
the fraction of the ``T*top_k`` choices a row computed (DeepSpeed drops the ones over capacity) and
``kept tok/s`` counts only those.
"""
from __future__ import annotations

import os
import platform
import random
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from ..moe.functions import combine, count_by_gate, gather, scatter
from ..moe.gates import NaiveGate
from ..moe.transformer import FMoETransformerMLP
from .timing import clock, clock_name, quartiles

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
    """Sorted rows through ``torch._grouped_mm`` (one call per linear for all experts), weights ``(E, out, in)``."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.gate = NaiveGate(d, E, 1, k)
        self.w1 = nn.Parameter(torch.randn(E, h, d) / d ** 0.5)
        self.b1 = nn.Parameter(torch.zeros(E, h))
        self.w2 = nn.Parameter(torch.randn(E, d, h) / h ** 0.5)
        self.b2 = nn.Parameter(torch.zeros(E, d))
        self.E, self.k = E, k

    def forward(self, x):                                               # (T, d)
        idx, score = self.gate(x)
        pos, counts = count_by_gate(idx, self.E)[:2]                    # (N,), (E,)
        expert = idx.reshape(-1)[pos]                                   # (N,) expert of each sorted row
        offs = counts.cumsum(0).to(torch.int32)
        xs = scatter(x, pos, self.k)                                    # (N, d)
        grouped_mm = torch._grouped_mm  # pyright: ignore[reportPrivateImportUsage]
        hid = F.gelu(grouped_mm(xs, self.w1.transpose(1, 2), offs=offs) + self.b1[expert])   # (N, h)
        out = grouped_mm(hid, self.w2.transpose(1, 2), offs=offs) + self.b2[expert]          # (N, d)
        return combine(gather(out, pos, idx.numel()), score)


class NaiveLoopMoE(nn.Module):
    """The textbook MoE: for each expert, find its tokens with a mask, run it, add the weighted output."""

    def __init__(self, d, h, E, k):
        super().__init__()
        self.gate = NaiveGate(d, E, 1, k)
        self.experts = nn.ModuleList([mlp(d, h) for _ in range(E)])

    def forward(self, x):
        idx, score = self.gate(x)                                       # (T, k)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if len(tok):
                y = y.index_add(0, tok, score[tok, slot, None] * expert(x[tok]))
        return y


def _ours_row(x, grad, d, h, k, E, name="ours (FMoETransformerMLP)"):
    layer = FMoETransformerMLP(E, d, h, top_k=k, init="linear")
    seen = {}
    layer.gate_hook = lambda idx, score, _: seen.update(share=(idx >= 0).float().mean().item())
    return _Row(name, layer, _fwd_bwd(layer, x, grad), lambda: seen.get("share", float("nan")))


def _deepspeed_rows(x, grad, d, h, k, E, factors):
    from ..ds.runtime import init_deepspeed, quiet
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


def round_ratios(a: dict, b: dict) -> list:
    """Per round, a's kept tokens/s over b's (rows ``a`` and ``b`` of one run): above 1, ``a`` is faster."""
    return [(a["share"] / ta) / (b["share"] / tb) for ta, tb in zip(a["times_ms"], b["times_ms"])]


def paired_speedup(a: dict, b: dict) -> tuple:
    """Median and IQR over rounds of (a's kept tokens/s / b's kept tokens/s): above 1, ``a`` is faster."""
    q1, med, q3 = quartiles(round_ratios(a, b))
    return med, (q1, q3)


def pooled_speedup(results: list, a: str, b: str) -> tuple:
    """Paired speed-up of row ``a`` over row ``b`` (prefixes) with the rounds of several runs of ONE shape
    pooled: ``(median, (q1, q3), rounds)``. Each round's ratio is still taken within its own round."""
    ratios = []
    for result in results:
        ratios += round_ratios(find_row(result, a), find_row(result, b))
    if not ratios:
        raise ValueError("pooled_speedup needs at least one run with timed rounds")
    q1, med, q3 = quartiles(ratios)
    return med, (q1, q3), len(ratios)


def noise_band(spread: dict) -> float:
    """How far from 1.0 a paired ratio can land by chance in this run: the larger of the repeat row's
    distance from 1 (``ours / ours again`` should be exactly 1) and half its IQR. ``spread``: a verdict
    entry ``{"paired_median", "iqr"}`` of the same layer timed twice."""
    lo, hi = spread["iqr"]
    return max(abs(spread["paired_median"] - 1.0), (hi - lo) / 2)


def classify(ratio: float, band: float, target: float = 1.0) -> str:
    """``"ahead"``, ``"tie"`` or ``"behind"``: a paired ratio against ``target`` with the run's noise band.
    A target met by less than the band is a tie, and so is one missed by less than it."""
    if ratio > target + band:
        return "ahead"
    if ratio < target - band:
        return "behind"
    return "tie"


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


def find_row(result: dict, prefix: str) -> dict:
    return next(r for r in result["rows"] if r["row"].startswith(prefix))


def format_table(result: dict) -> str:
    s = result["shape"]
    head = (f"T={s['T']} d={s['d']} h={s['h']} E={s['E']} top_k={s['top_k']}, fwd+bwd fp32, "
            f"{result['repeats']} interleaved rounds, {result.get('threads', '?')} thread(s), "
            f"{result.get('clock', 'wall clock')} (timings are not reproducible)")
    cols = (f"{'row':<26} {'median ms':>10} {'IQR':>6} {'share':>6} {'kept tok/s':>11} {'faults MB':>9} "
            f"{'vs dense (paired median, IQR)':>30}")
    lines = [head, cols]
    for r in result["rows"]:
        lo, hi = r["ratio_paired_iqr"]
        faults = r.get("faults_mb_per_step")
        faults = f"{faults:>9.0f}" if faults is not None else f"{'-':>9}"
        lines.append(f"{r['row']:<26} {r['median_ms']:>10.1f} {r['iqr_pct']:>5.0f}% {r['share']:>6.3f} "
                     f"{r['kept_tokens_per_s']:>11.0f} {faults} {r['ratio_paired_median']:>12.3f} [{lo:.3f}, {hi:.3f}]")
    return "\n".join(lines)


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

