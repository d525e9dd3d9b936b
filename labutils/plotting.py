"""Plots a reader would rather see than read: losses, parameter breakdowns, expert load. (Chapter 00.)

Each function returns the matplotlib Figure (display it, save it with ``fig.savefig``) and never calls
``plt.show()``, so notebooks and scripts behave the same.
"""
from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping

import torch

from .optional import require

matplotlib = require("matplotlib", "labutils.plotting")   # a clear ImportError with the pip command if missing
import matplotlib.pyplot as plt  # noqa: E402

COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _as_runs(runs) -> dict:
    if isinstance(runs, (str, bytes)) or not hasattr(runs, "__iter__"):
        raise TypeError(f"runs must be a list of losses or a dict name -> list, got {type(runs).__name__}")
    named = runs.items() if isinstance(runs, dict) else [("loss", runs)]
    return {str(k): _numbers(str(k), vals) for k, vals in named}


def _numbers(name: str, values) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"run {name!r} must be a list of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise TypeError(f"run {name!r}: value {i} is {v!r}, not a number") from None
    return out


def _smooth(values: list, weight: float) -> list:
    """Exponential moving average (TensorBoard style); weight 0 leaves values unchanged.

    A non-finite value is skipped: the average carries over it instead of turning NaN for the rest of the run.
    """
    out, last = [], None
    for v in values:
        if math.isfinite(v):
            last = v if last is None else weight * last + (1 - weight) * v
        out.append(math.nan if last is None else last)
    return out


def _check_losses(runs: dict, steps: dict, logy: bool) -> dict:
    """Refuse what would draw empty or misleading axes; return ``name -> count of non-finite values``."""
    if not runs or not any(runs.values()):
        raise ValueError("plot_losses got no values to plot (an empty list or dict)")
    empty = [name for name, values in runs.items() if not values]
    if empty:
        raise ValueError(f"run(s) {empty} have no values to plot")
    unknown = sorted(set(steps) - set(runs))
    if unknown:
        raise ValueError(f"steps names run(s) {unknown} that are not in runs {list(runs)}")
    for name, xs in steps.items():
        if len(xs) != len(runs[name]):
            raise ValueError(f"run {name!r}: {len(xs)} steps for {len(runs[name])} values")
    bad = {name: sum(not math.isfinite(v) for v in values) for name, values in runs.items()}
    if all(bad[name] == len(values) for name, values in runs.items()):
        raise ValueError("plot_losses: no finite value in any run (every loss is NaN or infinite)")
    if logy:
        low = {name: min(v for v in values if math.isfinite(v)) for name, values in runs.items()
               if any(math.isfinite(v) and v <= 0 for v in values)}
        if low:
            raise ValueError(f"logy=True needs values > 0, but run(s) {list(low)} reach {min(low.values())}; "
                             "plot with logy=False (or plot a positive quantity)")
    return {name: n for name, n in bad.items() if n}


def plot_losses(runs, *, smooth: float = 0.0, logy: bool = False, xlabel: str = "step", ylabel: str = "loss",
                title: str | None = None, steps: dict | None = None, figsize=(6.4, 3.6)):
    """Loss curves of one run (a list) or several named runs (a dict name -> list).

    ``smooth`` in [0, 1) draws an exponential moving average over the faint raw curve.
    ``steps`` optionally maps a run name to its x values (e.g. validation every 50 steps).
    A NaN or infinite loss leaves a gap in the raw curve, the average carries over it, and the legend and a
    warning say how many points were skipped. Empty runs, or ``logy`` with a value <= 0, raise ``ValueError``.
    """
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    runs = _as_runs(runs)
    skipped = _check_losses(runs, dict(steps or {}), logy)
    if skipped:
        warnings.warn("plot_losses: skipped non-finite values (NaN/inf): "
                      + ", ".join(f"{n} in {name!r}" for name, n in skipped.items()), stacklevel=2)
    fig, ax = plt.subplots(figsize=figsize, dpi=100)
    for i, (name, values) in enumerate(runs.items()):
        xs = (steps or {}).get(name, list(range(1, len(values) + 1)))
        color = COLORS[i % len(COLORS)]
        label = f"{name} ({skipped[name]} non-finite skipped)" if name in skipped else name
        raw = [v if math.isfinite(v) else math.nan for v in values]
        if smooth:
            ax.plot(xs, raw, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, _smooth(values, smooth), color=color, label=label, linewidth=2)
        else:
            ax.plot(xs, raw, color=color, label=label, linewidth=2, marker="o" if len(values) <= 12 else None)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or "")
    ax.grid(alpha=0.3)
    if len(runs) > 1 or smooth or skipped:
        ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def _human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def plot_param_counts(counts, *, title: str | None = None, log: bool = False, figsize=(6.4, 3.0)):
    """Horizontal bars of a parameter breakdown (a ParamCounts or a dict category -> count).

    Counts must be finite and >= 0 with a positive total (``log=True``: every count > 0), else ``ValueError``.
    """
    data = getattr(counts, "by_category", counts)
    if not isinstance(data, Mapping):
        raise TypeError(f"counts must be a ParamCounts or a dict category -> count, got {type(counts).__name__}")
    data = dict(data)
    if not data:
        raise ValueError("no parameters to plot (an empty breakdown)")
    bad = {k: v for k, v in data.items()
           if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)) or float(v) < 0}
    if bad:
        raise ValueError(f"parameter counts must be finite numbers >= 0, got {bad}")
    total = sum(data.values())
    if total == 0:
        raise ValueError(f"every count is 0: nothing to plot ({data})")
    if log and (zero := [k for k, v in data.items() if v == 0]):
        raise ValueError(f"log=True cannot draw a bar of 0: {zero}; drop those categories or use log=False")
    fig, ax = plt.subplots(figsize=figsize, dpi=100)
    names = list(data)[::-1]
    values = [data[n] for n in names]
    bars = ax.barh(names, values, color=[COLORS[i % len(COLORS)] for i in range(len(names))][::-1])
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f"  {_human(v)} ({v / total:.1%})",
                va="center", fontsize=9)
    if log:
        ax.set_xscale("log")
    ax.set_xlim(right=max(values) * (3 if log else 1.35))
    ax.set(xlabel="parameters", title=title or f"parameters by category (total {_human(total)})")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def plot_expert_load(load, *, title: str | None = None, ylabel: str = "step", normalize: bool = False,
                     annotate: bool | None = None, figsize=None):
    """Tokens per expert: bars for one vector (E,), a heatmap for (steps or layers, E).

    ``normalize`` divides each row by its total (shares instead of counts), which makes imbalance
    comparable across rows of different sizes. An empty load, or one with a NaN, infinite or negative count,
    raises ``ValueError`` naming the entries (token counts are never any of those).
    """
    load = torch.as_tensor(load).detach().float().cpu()
    if load.ndim not in (1, 2):
        raise ValueError(f"load must be (E,) or (rows, E), got shape {tuple(load.shape)}")
    if load.numel() == 0:
        raise ValueError(f"load is empty (shape {tuple(load.shape)}): no expert and no step to plot")
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        where = (~torch.isfinite(load) | (load < 0)).nonzero().tolist()
        raise ValueError(f"load must hold finite token counts >= 0; {len(where)} entries are not "
                         f"(at {[tuple(w) for w in where[:5]]}{' ...' if len(where) > 5 else ''})")
    if load.ndim == 1:
        fig, ax = plt.subplots(figsize=figsize or (6.4, 3.0), dpi=100)
        values = load / load.sum().clamp_min(1) if normalize else load
        ax.bar(range(len(values)), values.tolist(), color=COLORS[0])
        ax.axhline(values.mean().item(), color="k", linestyle="--", linewidth=1, label="balanced")
        ax.set(xlabel="expert", ylabel="share of tokens" if normalize else "tokens", title=title or "")
        ax.legend(frameon=False)
        ax.spines[["top", "right"]].set_visible(False)
        fig.tight_layout()
        return fig
    values = load / load.sum(1, keepdim=True).clamp_min(1) if normalize else load
    rows, experts = values.shape
    fig, ax = plt.subplots(figsize=figsize or (min(12, 2 + 0.45 * experts), min(8, 1.5 + 0.35 * rows)), dpi=100)
    im = ax.imshow(values.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    if annotate if annotate is not None else rows * experts <= 150:
        fmt = "{:.2f}" if normalize else "{:.0f}"
        vmax = values.max().item() or 1
        for i in range(rows):
            for j in range(experts):
                v = values[i, j].item()
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8,
                        color="white" if v < 0.6 * vmax else "black")
    ax.set(xlabel="expert", ylabel=ylabel, title=title or "")
    fig.colorbar(im, ax=ax, label="share of tokens" if normalize else "tokens")
    fig.tight_layout()
    return fig


__all__ = ["plot_losses", "plot_param_counts", "plot_expert_load"]
_ = matplotlib  # the backend is chosen by the caller (MPLBACKEND / notebook)
