"""Side-by-side speed of MoE MLP layers on one shape, forward + backward. (Used in chapter 01.)

Rows (all fp32, top-k routing, the same ``T`` tokens):

* ``dense (limit)``: one MLP with hidden ``top_k * h``: exactly the FLOPs of the MoE experts, none of the routing;
* ``E MLPs, pre-sliced``: ``E`` separate ``nn.Sequential`` MLPs on tokens already grouped by expert;
* ``naive loop``: a NaiveGate, then per expert a boolean mask, ``index_select``, MLP, ``index_add``;
* ``DeepSpeed cf=...``: ``deepspeed.moe.layer.MoE`` (top-2, drop_tokens) at the given capacity factors;
* ``ours``: :class:`labutils.moe.FMoETransformerMLP`.

``share`` is the fraction of the ``T*top_k`` token-expert choices a row actually computed (DeepSpeed drops
the ones over capacity); ``kept tok/s`` counts only those. Rows are timed interleaved and the best of
``repeats`` is kept, which is the fairest figure on a shared machine; the median is reported too, and ``paired``
is the median over rounds of (dense time / row time) within the same round, robust to slow drifts.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch
from torch import nn

from .gates import NaiveGate
from .transformer import FMoETransformerMLP


def mlp(d: int, h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))


class _Row:
    """A callable step (forward + backward) plus the share of choices it computed in its last call."""

    def __init__(self, name: str, module: nn.Module, step, share=lambda: 1.0):
        self.name, self.module, self.step, self.share = name, module, step, share
        self.times = []

    def run(self) -> float:
        for p in self.module.parameters():
            p.grad = None
        clock = bench_clock()
        t0 = clock()
        self.step()
        return clock() - t0


def bench_clock():
    """Wall clock, except with ONE torch thread: then the thread's CPU time, which other processes sharing the
    cores do not inflate (the fairest figure on a busy machine; every op runs on the calling thread)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _dense_row(x, grad, d, h, k):
    dense = mlp(d, k * h)

    def step():
        xx = x.detach().requires_grad_()
        dense(xx).backward(grad)
    return _Row("dense (limit)", dense, step)


def _sliced_row(x, grad, d, h, k, E):
    experts = nn.ModuleList([mlp(d, h) for _ in range(E)])
    sizes = [len(c) for c in torch.arange(x.shape[0] * k).chunk(E)]
    xs = x.repeat(k, 1).split(sizes)                                    # (T*k, d) in E pre-sliced parts
    gs = grad.repeat(k, 1).split(sizes)

    def step():
        outs = [e(part.detach().requires_grad_()) for e, part in zip(experts, xs)]
        torch.autograd.backward(outs, list(gs))
    return _Row("E MLPs, pre-sliced", experts, step)


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


def _naive_row(x, grad, d, h, k, E):
    layer = NaiveLoopMoE(d, h, E, k)

    def step():
        layer(x.detach().requires_grad_()).backward(grad)
    return _Row("naive loop", layer, step)


def _ours_row(x, grad, d, h, k, E):
    layer = FMoETransformerMLP(E, d, h, top_k=k)
    seen = {}
    layer.gate_hook = lambda idx, score, _: seen.update(share=(idx >= 0).float().mean().item())

    def step():
        layer(x.detach().requires_grad_()).backward(grad)
    return _Row("ours (FMoETransformerMLP)", layer, step, lambda: seen.get("share", float("nan")))


def _deepspeed_rows(x, grad, d, h, k, E, factors):
    import contextlib
    try:
        from labutils.ds import init_deepspeed, quiet
    except ImportError:  # pragma: no cover - the lab always has labutils.ds
        init_deepspeed, quiet = _single_process_gloo, contextlib.nullcontext
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


def _single_process_gloo():  # pragma: no cover - fallback when labutils.ds is absent
    import socket

    import torch.distributed as dist
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def bench_shape(T: int, d: int, h: int, E: int, top_k: int = 2, repeats: int = 5, deepspeed_factors=(1.0, 2.0),
                naive: bool = True, seed: int = 0, verbose: bool = True) -> dict:
    """Time every row on one shape; returns ``{"shape": ..., "rows": [...]}`` with ratios to the dense limit."""
    torch.manual_seed(seed)
    x, grad = torch.randn(T, d), torch.randn(T, d)
    rows = [_dense_row(x, grad, d, h, top_k)]
    if naive:
        rows += [_sliced_row(x, grad, d, h, top_k, E), _naive_row(x, grad, d, h, top_k, E)]
    if deepspeed_factors:
        rows += _deepspeed_rows(x, grad, d, h, top_k, E, deepspeed_factors)
    rows.append(_ours_row(x, grad, d, h, top_k, E))
    for row in rows:  # warm-up (allocator, first-call costs)
        row.run()
    for _ in range(repeats):
        for row in rows:
            row.times.append(row.run())
    limit = min(rows[0].times)
    out = []
    for row in rows:
        best, share = min(row.times), row.share()
        # each round times every row once, back to back: the median of the per-round ratios cancels slow drifts
        paired = statistics.median(lim / t for lim, t in zip(rows[0].times, row.times))
        out.append(dict(row=row.name, best_ms=1e3 * best, median_ms=1e3 * statistics.median(row.times),
                        tokens_per_s=T / best, share=share, kept_tokens_per_s=share * T / best,
                        ratio_to_limit=limit / best, ratio_paired_median=paired))
    clock = "thread CPU time (1 thread)" if bench_clock() is time.thread_time else "wall clock"
    result = dict(shape=dict(T=T, d=d, h=h, E=E, top_k=top_k), repeats=repeats, threads=torch.get_num_threads(),
                  clock=clock, rows=out)
    if verbose:
        print(format_table(result))
    return result


def format_table(result: dict) -> str:
    s = result["shape"]
    head = (f"T={s['T']} d={s['d']} h={s['h']} E={s['E']} top_k={s['top_k']}, fwd+bwd fp32, best of "
            f"{result['repeats']}, {result.get('threads', '?')} thread(s), {result.get('clock', 'wall clock')} "
            f"(timings are not reproducible)")
    cols = (f"{'row':<28} {'best ms':>9} {'median ms':>10} {'tok/s':>9} {'share':>6} {'kept tok/s':>11} "
            f"{'vs limit':>9} {'paired':>7}")
    lines = [head, cols]
    for r in result["rows"]:
        lines.append(f"{r['row']:<28} {r['best_ms']:>9.1f} {r['median_ms']:>10.1f} {r['tokens_per_s']:>9.0f} "
                     f"{r['share']:>6.3f} {r['kept_tokens_per_s']:>11.0f} {r['ratio_to_limit']:>9.3f} "
                     f"{r.get('ratio_paired_median', float('nan')):>7.3f}")
    return "\n".join(lines)


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (``mallopt``), as jemalloc/tcmalloc do.

    Without it every large tensor (> 32 MB) is a fresh ``mmap`` whose pages fault in on first touch, on every
    step; an MoE layer, with E/k times the dense layer's parameters, pays that on E/k times more gradient
    memory. Applies to every row alike. Returns False where glibc is not available.
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


def machine_info() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                loadavg=load)
