"""Chapter 08's figures, drawn from live rows and benchmark records. (Taught in chapter 08.)

Each function returns a matplotlib Figure (:func:`display` shows and closes one in a notebook): the ratio curves
of the dispatch sweeps (:func:`live_sweep`, :func:`recorded_sweeps`, :func:`topk`), the matmul sweep
(:func:`matmul`), the roofline (:func:`roofline`), work and memory (:func:`work_memory`), the core's profiled
phases (:func:`breakdown`), the all-to-all and its fit (:func:`comm`) and a training step's phases
(:func:`step_phases`). Nothing here measures or judges: the chapter's cells do, and hand the numbers over.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import NullLocator

from .breakdown import PHASES, judge_overhead
from .dispatch import DESIGNS

__all__ = ["display", "ratio_axes", "live_sweep", "recorded_sweeps", "topk", "matmul", "roofline", "work_memory",
           "breakdown", "comm", "step_phases"]

RATIO_DESIGNS = (*DESIGNS, "separate")


def display(fig) -> None:
    """Show ``fig`` in a notebook (printed as its repr anywhere else), then close it so it is not shown twice."""
    from IPython.display import display as show

    show(fig)
    plt.close(fig)


def ratio_axes(ax, rows, x, designs=RATIO_DESIGNS, target=None, title=""):
    """Paired-median ratio (dense time / design time) against ``x`` per design; the core bold with its IQR band."""
    for name in designs:
        pts = sorted((r[x], r["ratio"]) for r in rows if r["design"] == name)
        if pts:
            ax.plot(*zip(*pts), "o-" if name == "core" else ".-", lw=2.5 if name == "core" else 1, label=name)
        if name == "core" and all("ratio_iqr" in r for r in rows if r["design"] == name):
            iqr = sorted((r[x], *r["ratio_iqr"]) for r in rows if r["design"] == name)
            ax.fill_between([v[0] for v in iqr], [v[1] for v in iqr], [v[2] for v in iqr], alpha=0.2, label="core IQR")
    ax.axhline(1.0, color="k", lw=0.8)
    if target:
        ax.axhline(target, color="r", ls=":", lw=1, label=f"target {target}")
    ax.set(xscale="log", xlabel=x.replace("_", " "), ylabel="dense time / design time\n(paired median)", title=title)
    ax.set_xticks(sorted({r[x] for r in rows}), [f"{v:g}" for v in sorted({r[x] for r in rows})])
    ax.xaxis.set_minor_locator(NullLocator())


def live_sweep(rows, title):
    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=100)
    ratio_axes(ax, rows, "num_expert", title=title)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _second(ax, rows2, sweep, x):
    pts = sorted((r[x], r["ratio"]) for r in rows2 if r["sweep"] == sweep and r["design"] == "core")
    if pts:
        ax.plot(*zip(*pts), "k:", lw=1.5, label="core, 2nd recording")


def recorded_sweeps(rows, rows2, config, target=0.9):
    """The experts and tokens-per-expert sweeps of the first recording, the core of the second dotted."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100, sharey=True)
    for ax, sweep, x, title in ((axes[0], "experts", "num_expert", f"more experts, T={config['experts']['tokens']}"),
                                (axes[1], "tokens", "tokens_per_expert",
                                 f"tokens per expert, E={config['tokens']['num_expert']}")):
        ratio_axes(ax, [r for r in rows if r["sweep"] == sweep], x, target=target, title=f"recorded, 1 thread: {title}")
        _second(ax, rows2, sweep, x)
    axes[1].legend(fontsize=7, ncol=2)
    return fig


def topk(rows, config):
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ratio_axes(ax, [r for r in rows if r["sweep"] == "topk"], "top_k",
               title=f"top-k, T={config['topk']['tokens']}, E={config['topk']['num_expert']} (FLOPs grow with k)")
    ax.legend(fontsize=7, ncol=2)
    return fig


def matmul(mm):
    """GFLOP/s of the two expert matmuls against rows per expert, the square matmul as a dashed line."""
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    rows = [r["rows"] for r in mm["expert"]]
    ax.plot(rows, [r["gflops_up"] for r in mm["expert"]], "o-", label="(m, d) @ (d, h)")
    ax.plot(rows, [r["gflops_down"] for r in mm["expert"]], "s-", label="(m, h) @ (h, d)")
    above = [r for r in mm["expert"] if max(r["gflops_up"], r["gflops_down"]) > mm["peak_gflops"]]
    ax.axhline(mm["peak_gflops"], color="k", ls="--",
               label=f"square 512 matmul {mm['peak_gflops']:.0f}" + (
                   f": {len(above)} expert-shape points above it, so a reference, not a peak" if above else ""))
    ax.set(xscale="log", xlabel="rows per expert m", ylabel="GFLOP/s",
           title=f"matmul, d={mm['d_model']} h={mm['d_hidden']}")
    ax.set_xticks(rows, [f"{m:g}" for m in rows], fontsize=7, rotation=45)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=7, loc="lower right")
    return fig


def roofline(tok_rows, mm, roof, intensity, designs=("core", "padded", "grouped_mm", "loop", "ds_cf1", "separate",
                                                       "dense")):
    """Useful GFLOP/s against the expert matmul's arithmetic intensity (``intensity(m)``), the measured roof dashed."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    for name in designs:
        pts = sorted((intensity(r["tokens_per_expert"]), r["gflops"]) for r in tok_rows if r["design"] == name)
        ax.plot(*zip(*pts), "o-" if name == "core" else ".-", lw=2.5 if name == "core" else 1, label=name)
    above = [r for r in tok_rows if r["gflops"] > roof]
    ax.axhline(roof, color="k", ls="--", label=f"highest measured matmul {roof:.0f} GFLOP/s")
    ax.plot([intensity(r["rows"]) for r in mm["expert"]], [r["gflops_up"] for r in mm["expert"]], "k:",
            label="expert-shape matmul (2 threads)")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity of the expert matmul (FLOP/byte)",
           ylabel="useful GFLOP/s", title="achieved throughput against the measured roof" if not above else
           f"{len(above)} point(s) above the measured matmul: it is a reference, not a roof")
    ms = sorted({r["tokens_per_expert"] for r in tok_rows})
    ax.xaxis.set_major_locator(FixedLocator([intensity(m) for m in ms]))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{intensity(m):.0f} (m={m:g})" for m in ms], fontsize=7, rotation=35, ha="right")
    ys = [v for v in (5, 10, 20, 50, 100, 200, 500) if ax.get_ylim()[0] <= v <= ax.get_ylim()[1]]
    ax.yaxis.set_major_locator(FixedLocator(ys))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def work_memory(picks: dict, names, grad_mb: float, E_grad: int):
    """Peak memory and rows computed per choice (kept, padding hatched) per design; ``picks``: {E: {design: row}}."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), dpi=100)
    width = 0.38
    for i, (E, rs) in enumerate(picks.items()):
        at = [j + i * width for j in range(len(names))]
        axes[0].bar(at, [rs[n]["peak_mb"] for n in names], width, label=f"E={E}")
        kept = [rs[n]["kept"] for n in names]
        axes[1].bar(at, kept, width, label=f"kept, E={E}")
        axes[1].bar(at, [rs[n]["rows"] - rs[n]["kept"] for n in names], width, bottom=kept, hatch="//", alpha=0.5,
                    label=f"padding, E={E}")
    for a, t in zip(axes, ("peak memory of one forward+backward (MB)", "rows computed per (token, choice)")):
        a.set_xticks([j + width / 2 for j in range(len(names))], names, rotation=30, fontsize=8)
        a.set_title(t, fontsize=10)
        a.legend(fontsize=7)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(grad_mb, color="k", ls="--", lw=1)
    axes[0].text(0, grad_mb, f"expert weight gradients at E={E_grad}", fontsize=7, va="bottom")
    return fig


def _breakdown_axes(ax, bds, title):
    marks = {"ok": "", "too high": "\n(inflated)", "too noisy": "\n(not judged)"}
    labels = [str(b["tokens_per_expert"]) + marks[judge_overhead(b)["call"]] for b in bds]
    bottom = [0.0] * len(bds)
    for ph in (*PHASES, "other"):
        share = [max(b["total"][ph], 0.0) / b["profiled_s"] for b in bds]
        ax.bar(labels, share, bottom=bottom, label=ph)
        bottom = [u + v for u, v in zip(bottom, share)]
    ax.set(xlabel="tokens per expert", ylabel="share of forward+backward", title=title, ylim=(0, 1.05))


def breakdown(live_bds, live_title, rec_bds, rec_title):
    """Each phase's share of the core's profiled step, live and recorded, a profile not judged well-conditioned
    marked under its bar."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100, sharey=True)
    _breakdown_axes(axes[0], live_bds, live_title)
    _breakdown_axes(axes[1], rec_bds, rec_title)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


def comm(points: dict, fits: dict, cores: int):
    """ms per all-to-all against bytes per rank for each world size (``points``: {w: [(bytes, s)]}), each with
    its fitted ``latency + bytes / bandwidth`` dashed; more workers than cores said in the legend."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=100)
    for w, pts in points.items():
        f = fits[w]
        share = "" if w <= cores else f", {w / cores:g} per core: time-sharing, not the network"
        xs = [b for b, _ in pts]
        line, = ax.plot(xs, [t * 1e3 for _, t in pts], "o-", label=f"{w} workers on {cores} cores{share}")
        ax.plot(xs, [(f["latency_s"] + b / (f["bandwidth_gb_s"] * 1e9)) * 1e3 for b in xs], "--",
                color=line.get_color(), lw=1, label=f"  fit: {f['latency_s'] * 1e3:.2f} ms + bytes / "
                f"{f['bandwidth_gb_s']:.2f} GB/s (worst miss {f['max_rel_error']:.0%})")
    ax.set(xscale="log", yscale="log", xlabel="bytes sent per rank", ylabel="ms per all-to-all",
           title=f"gloo all-to-all on {cores} cores" + (" (4 and 8 workers oversubscribe them)"
                                                          if max(points) > cores else ""))
    ax.legend(fontsize=6)
    return fig


def step_phases(grouped: dict, title: str):
    """One stacked bar per model (``grouped``: {model: {group: ms}}), each group's ms written on it from 2 ms."""
    fig, ax = plt.subplots(figsize=(8.5, 2.6), dpi=100)
    models = list(grouped)
    left = dict.fromkeys(models, 0.0)
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    for i, name in enumerate(grouped[models[-1]]):
        for row, m in enumerate(models):
            w = grouped[m].get(name, 0.0)
            ax.barh(row, w, left=left[m], color=colors[i], label=name if row == len(models) - 1 else None)
            if w >= 2.0:
                ax.text(left[m] + w / 2, row, f"{w:.1f}", ha="center", va="center", fontsize=8, color="white")
            left[m] += w
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel("ms per training step (phases timed inside real steps)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    ax.set_title(title, fontsize=9)
    return fig
