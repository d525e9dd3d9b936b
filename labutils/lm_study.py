"""Chapter 05's study: MoE against dense on real text at equal active parameters, over seeds. (Chapter 05.)

Three models differ only in their feed-forward (:func:`variants`):

* ``dense``: an MLP of hidden width ``4 d``;
* ``MoE``: ``E`` experts of width ``4 d / k``, top-``k`` noisy gating: the same active parameters per token
  as ``dense`` (plus the router), ``E / k`` times its feed-forward parameters;
* ``dense-wide``: one MLP of width ``4 d E / k``, MoE's total parameters and ``E / k`` times the compute.

``dense-wide`` is the regime check: if it does not beat ``dense`` clearly, the runs are data- or step-limited
and no amount of extra parameters (MoE's included) can show. Ablations change one MoE knob at a time.

:func:`run_study` trains every (model, seed), optionally on several processes; :func:`summarize` reduces the
record to means, standard deviations and verdicts; :func:`verdict_lines` writes the summary text *from those
numbers*. ``benchmarks/moe_vs_dense.py`` records the ``full`` preset; the chapter runs ``tiny`` and shows the
recorded ``full`` run. Each run's batch order and initialisation come from its seed.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import multiprocessing
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .data import CharBatches, Corpus, stdlib_file_corpus
from .models import CharLM, make_ffn
from .train import lm_cross_entropy, train

MAIN = ("dense", "MoE", "dense-wide")
LOAD_WINDOWS = 40  # training loss and expert load are kept as means/sums over this many windows of steps


@dataclass(frozen=True)
class StudyConfig:
    """One study: model shape, training length, seeds, and which ablations run (on the first seed)."""
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    block: int = 64
    batch: int = 32
    steps: int = 2000
    lr: float = 3e-3
    eval_every: int = 125
    num_expert: int = 8
    top_k: int = 2
    aux_coef: float = 0.01
    seeds: tuple = (0, 1, 2)
    ablations: tuple = ("top-1", "E=4", "E=16", "no balance loss")
    val_one_in: int = 25        # one stdlib file in this many is held out
    val_tokens: int = 0         # 0: the whole held-out set; n: its first n characters (tiny preset only)
    threads: int = 1            # torch threads per run
    name: str = "custom"


PRESETS = {
    "tiny": StudyConfig(d_model=32, block=32, batch=16, steps=150, eval_every=30, seeds=(0, 1), ablations=(),
                        lr=5e-3, val_tokens=32_768, name="tiny"),
    "full": StudyConfig(name="full"),
}


@dataclass(frozen=True)
class Variant:
    """A feed-forward: ``hidden`` is per expert for MoE (``experts`` > 0)."""
    hidden: int
    experts: int = 0
    top_k: int = 0
    aux_coef: float = 0.0

    def ffn(self, d: int):
        if not self.experts:
            return make_ffn("dense", d, self.hidden)
        from .moe import NoisyGate
        return make_ffn("fmoe", d, self.hidden, num_expert=self.experts, top_k=self.top_k, gate=NoisyGate)


def variants(cfg: StudyConfig) -> dict:
    """The three main models and the ablations, every MoE at the dense model's active feed-forward width."""
    d, E, k = cfg.d_model, cfg.num_expert, cfg.top_k
    table = {
        "dense": Variant(4 * d),
        "MoE": Variant(4 * d // k, E, k, cfg.aux_coef),
        "dense-wide": Variant(4 * d * E // k),
        "top-1": Variant(4 * d, E, 1, cfg.aux_coef),              # same active width, twice the experts' params
        "E=4": Variant(4 * d // k, 4, k, cfg.aux_coef),
        "E=16": Variant(4 * d // k, 16, k, cfg.aux_coef),
        "no balance loss": Variant(4 * d // k, E, k, 0.0),
    }
    unknown = set(cfg.ablations) - set(table)
    if unknown:
        raise ValueError(f"unknown ablation(s) {sorted(unknown)}; choose from {sorted(set(table) - set(MAIN))}")
    return {name: table[name] for name in MAIN + tuple(cfg.ablations)}


def build(cfg: StudyConfig, variant: Variant, vocab_size: int, seed: int) -> CharLM:
    torch.manual_seed(seed)
    return CharLM(vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.block,
                  ffn=lambda: variant.ffn(cfg.d_model))


def train_flops_per_token(cfg: StudyConfig, variant: Variant, vocab_size: int) -> int:
    """Matmul FLOPs per training token (forward + backward = 3x forward, multiply-add = 2 FLOPs). The router
    of ``NoisyGate`` is two ``(d, E)`` matmuls (clean and noise logits)."""
    d, T = cfg.d_model, cfg.block
    active_ffn = 2 * d * variant.hidden * max(1, variant.top_k) + 2 * d * variant.experts  # experts + noisy router
    attention = 4 * d * d + 2 * T * d                                                  # projections + scores
    forward = 2 * (cfg.n_layers * (active_ffn + attention) + d * vocab_size)
    return 3 * forward


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, block: int, batch: int = 256) -> float:
    """Mean next-character cross-entropy over ``data`` cut into consecutive windows of ``block`` characters."""
    n = (len(data) - 1) // block
    if n == 0:
        raise ValueError(f"held-out data has {len(data)} tokens: need at least block + 1 = {block + 1}")
    x = data[: n * block].view(n, block)               # (n, T)
    y = data[1: n * block + 1].view(n, block)          # (n, T)
    total = 0.0
    for i in range(0, n, batch):
        logits = model(x[i:i + batch])                 # (b, T, vocab)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                                   reduction="sum").item()
    return total / (n * block)


def _warm_up(cfg: StudyConfig, variant: Variant, vocab_size: int) -> None:
    model = build(cfg, variant, vocab_size, seed=0)
    x = torch.randint(vocab_size, (cfg.batch, cfg.block))  # (B, T)
    for _ in range(2):
        lm_cross_entropy(model(x), x).backward()


@functools.lru_cache(maxsize=2)
def corpus_for(val_one_in: int) -> Corpus:
    return stdlib_file_corpus(val_one_in)


def run_one(cfg: StudyConfig, name: str, seed: int) -> dict:
    """Train one (model, seed) and return its record: validation curve, timings, FLOPs and expert load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run_one(cfg, name, seed)
    finally:
        torch.set_num_threads(threads)  # a notebook kernel keeps its own setting


def _run_one(cfg: StudyConfig, name: str, seed: int) -> dict:
    corpus = corpus_for(cfg.val_one_in)
    val = corpus.val[: cfg.val_tokens] if cfg.val_tokens else corpus.val
    variant = variants(cfg)[name]
    _warm_up(cfg, variant, corpus.vocab_size)  # first-call costs (allocations, kernels) stay off the clock
    model = build(cfg, variant, corpus.vocab_size, seed)
    clock = {"eval": 0.0, "t0": time.perf_counter(), "train_s": []}

    def evaluate(m):
        t = time.perf_counter()
        clock["train_s"].append(t - clock["t0"] - clock["eval"])  # training time so far, evaluations excluded
        loss = heldout_loss(m, val, cfg.block)
        clock["eval"] += time.perf_counter() - t
        return loss

    result = train(model, CharBatches(corpus.train, cfg.batch, cfg.block, seed=seed), steps=cfg.steps, lr=cfg.lr,
                   aux_coef=variant.aux_coef, loss_fn=lm_cross_entropy, eval_every=cfg.eval_every,
                   eval_fn=evaluate, progress=False, record_load=bool(variant.experts))
    total = sum(p.numel() for p in model.parameters())
    window = max(1, cfg.steps // LOAD_WINDOWS)
    n = cfg.steps // window * window
    losses = torch.tensor(result.losses[:n]).view(-1, window).mean(1)                     # (windows,)
    load = (result.expert_load()[:n].view(-1, window, variant.experts).sum(1).tolist()  # (windows, experts)
            if variant.experts else [])
    return {"name": name, "seed": seed, "val_steps": [s for s, _ in result.val], "val": [v for _, v in result.val],
            "train_seconds": clock["train_s"], "eval_seconds": clock["eval"], "window": window,
            "train_loss": losses.tolist(),
            "flops_per_step": train_flops_per_token(cfg, variant, corpus.vocab_size) * cfg.batch * cfg.block,
            "params": total, "load": load, "variant": asdict(variant)}


def run_study(cfg: StudyConfig, jobs: int = 1, log=print) -> dict:
    """Every main model on every seed, then each ablation on the first seed; ``jobs`` processes at a time."""
    if not cfg.seeds or isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"need at least one seed and jobs >= 1, got seeds={cfg.seeds!r}, jobs={jobs!r}")
    variants(cfg)  # unknown ablations fail here, before any process starts
    corpus = corpus_for(cfg.val_one_in)
    todo = [(name, seed) for seed in cfg.seeds for name in MAIN] + [(a, cfg.seeds[0]) for a in cfg.ablations]
    t0 = time.perf_counter()
    runs = []
    if jobs == 1:
        for name, seed in todo:
            runs.append(_logged(run_one(cfg, name, seed), t0, log))
    else:
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter per worker, from a notebook too
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_one, cfg, name, seed) for name, seed in todo]
            for future in concurrent.futures.as_completed(futures):
                runs.append(_logged(future.result(), t0, log))
    runs.sort(key=lambda r: (todo.index((r["name"], r["seed"]))))
    return {"config": asdict(cfg), "corpus": {"source": corpus.source, "sha256": corpus.sha256,
                                              "train_chars": len(corpus.train), "val_chars": len(corpus.val),
                                              "val_used": cfg.val_tokens or len(corpus.val)},
            "jobs": jobs, "wall_seconds": time.perf_counter() - t0, "runs": runs}


def _logged(run: dict, t0: float, log) -> dict:
    if log:
        log(f"{time.perf_counter() - t0:7.1f} s  {run['name']:<16} seed {run['seed']}  "
            f"final validation loss {run['val'][-1]:.4f}  ({run['train_seconds'][-1]:.0f} s training)")
    return run


# --- reducing the record -------------------------------------------------------------------------------


@dataclass
class Curve:
    """One model over its seeds: mean and standard deviation of the validation loss at each evaluation."""
    steps: list
    mean: list
    std: list
    finals: list              # final validation loss per seed
    flops: list = field(default_factory=list)   # training FLOPs at each evaluation
    seconds: list = field(default_factory=list)  # mean training seconds at each evaluation

    @property
    def final(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def final_std(self) -> float:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else float("nan")


def curves(record: dict) -> dict:
    """``{model: Curve}`` over the seeds each model ran."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in record["runs"]):
        runs = [r for r in record["runs"] if r["name"] == name]
        vals = torch.tensor([r["val"] for r in runs], dtype=torch.float64)  # (seeds, evaluations)
        std = vals.std(0) if len(runs) > 1 else torch.full_like(vals[0], float("nan"))
        steps = runs[0]["val_steps"]
        out[name] = Curve(steps, vals.mean(0).tolist(), std.tolist(), vals[:, -1].tolist(),
                          [s * runs[0]["flops_per_step"] for s in steps],
                          torch.tensor([r["train_seconds"] for r in runs]).mean(0).tolist())
    return out


def steps_to_reach(steps: list, losses: list, target: float) -> float | None:
    """First step at which the curve reaches ``target`` (linear between evaluations), or None if it never does."""
    prev_s, prev_v = 0, math.inf
    for s, v in zip(steps, losses):
        if v <= target:
            if not math.isfinite(prev_v):
                return float(s)
            return prev_s + (s - prev_s) * (prev_v - target) / (prev_v - v)
        prev_s, prev_v = s, v
    return None


def summarize(record: dict) -> dict:
    """The verdicts, each computed from the record: regime check, MoE vs dense, steps speed-up."""
    c = curves(record)
    missing = [name for name in MAIN if name not in c]
    if missing:
        raise ValueError(f"the record has no run of {missing}: summarize compares {list(MAIN)}")
    dense, moe, wide = c["dense"], c["MoE"], c["dense-wide"]
    noise = math.sqrt((dense.final_std ** 2 + moe.final_std ** 2) / 2)  # pooled seed standard deviation
    wide_noise = math.sqrt((dense.final_std ** 2 + wide.final_std ** 2) / 2)
    moe_runs = [r for r in record["runs"] if r["name"] == "MoE"]
    reach = [steps_to_reach(r["val_steps"], r["val"], dense.final) for r in moe_runs]
    speedups = [dense.steps[-1] / s for s in reach if s]
    return {
        "final": {name: (cv.final, cv.final_std) for name, cv in c.items()},
        "gap": dense.final - moe.final, "noise": noise,
        "moe_wins": dense.final - moe.final > 2 * noise,
        "wide_gap": dense.final - wide.final, "wide_noise": wide_noise,
        "regime_ok": dense.final - wide.final > 2 * wide_noise,
        "speedups": speedups, "reached": sum(s is not None for s in reach), "seeds": len(moe_runs),
        "speedup": statistics.fmean(speedups) if speedups else None,
        "speedup_std": statistics.stdev(speedups) if len(speedups) > 1 else None,
        "at_dense_time": (dense.seconds[-1], {n: loss_at(c[n].seconds, c[n].mean, dense.seconds[-1])
                                              for n in MAIN}),
    }


def verdict_lines(summary: dict, target_speedup: float = 1.3) -> list:
    """The chapter's verdict, written from the numbers (never in advance)."""
    f, s = summary["final"], summary
    lines = [f"{name:<16} final validation loss {m:.4f} " + (f"± {sd:.4f}" if math.isfinite(sd) else "(one seed)")
             for name, (m, sd) in f.items()]
    lines.append(f"regime check: dense-wide is {s['wide_gap']:+.4f} nats below dense, 2 × seed std = "
                 f"{2 * s['wide_noise']:.4f}: " + ("capacity-limited, extra parameters help"
                                                  if s["regime_ok"] else
                                                  "NOT shown: extra parameters do not help clearly here, so "
                                                  "MoE cannot be expected to either"))
    lines.append(f"MoE vs dense: {s['gap']:+.4f} nats, 2 × pooled seed std = {2 * s['noise']:.4f}: "
                 + ("MoE is better, beyond the noise" if s["moe_wins"] else "inconclusive (within the noise)"))
    if s["speedup"] is not None:
        spread = f" ± {s['speedup_std']:.2f}" if s["speedup_std"] is not None else ""
        lines.append(f"steps for MoE to reach dense's final loss: dense needs {s['speedup']:.2f}{spread}× "
                     f"as many ({s['reached']} of {s['seeds']} seeds reached it); target ≥ {target_speedup}: "
                     + ("met" if s["speedup"] >= target_speedup and s["reached"] == s["seeds"] else "NOT met"))
    else:
        lines.append("steps for MoE to reach dense's final loss: no MoE seed reached it")
    if "at_dense_time" in s:
        t, at = s["at_dense_time"]
        lines.append(f"at equal CPU time (dense's {t:.0f} s of training): " +
                     ", ".join(f"{n} {v:.4f}" if v is not None else f"{n} not yet evaluated" for n, v in at.items()))
    return lines


def loss_at(xs: list, ys: list, x: float) -> float | None:
    """The curve's value at ``x`` (linear between points), None before its first point."""
    if x < xs[0]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] if x == xs[-1] else None


def ablation_lines(record: dict) -> list:
    """Each ablation (one seed) against the MoE run of the same seed, judged by twice MoE's seed std."""
    c = curves(record)
    moe_runs = {r["seed"]: r["val"][-1] for r in record["runs"] if r["name"] == "MoE"}
    noise = c["MoE"].final_std
    lines = []
    for r in record["runs"]:
        if r["name"] in MAIN:
            continue
        diff = r["val"][-1] - moe_runs[r["seed"]]
        word = ("within the noise" if not abs(diff) > 2 * noise else "worse than MoE" if diff > 0
                else "better than MoE")
        lines.append(f"{r['name']:<16} {r['val'][-1]:.4f} vs MoE (same seed) {moe_runs[r['seed']]:.4f}: "
                     f"{diff:+.4f}, 2 × MoE seed std = {2 * noise:.4f}: {word}")
    return lines


# --- figures ---------------------------------------------------------------------------------------------


def plot_study(record: dict):
    """Validation loss (mean ± std over seeds, as a band) against steps, training FLOPs and CPU seconds."""
    from .plotting import COLORS, plt

    c = curves(record)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100, sharey=True)
    xs = {"steps": lambda cv: cv.steps, "training FLOPs (10^12)": lambda cv: [f / 1e12 for f in cv.flops],
          f"training time, s (CPU: {record['config']['threads']} thread per run, {record['jobs']} side by side)":
          lambda cv: cv.seconds}
    for ax, (label, x) in zip(axes, xs.items()):
        for color, name in zip(COLORS, MAIN):
            cv = c[name]
            mean, std = torch.tensor(cv.mean), torch.tensor(cv.std).nan_to_num(0.0)
            ax.plot(x(cv), mean.tolist(), color=color, label=f"{name} ({len(cv.finals)} seeds)")
            ax.fill_between(x(cv), (mean - std).tolist(), (mean + std).tolist(), color=color, alpha=0.25, lw=0)
        ax.set(xlabel=label)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("validation loss (nats/char)")
    axes[0].axhline(c["dense"].final, color="k", lw=0.8, ls=":", label="dense's final loss")
    axes[0].legend(frameon=False)
    low = min(min(cv.mean) for cv in c.values())
    axes[0].set_ylim(low - 0.05, min(c["dense"].mean[0], low + 1.0))
    fig.suptitle(f"{record['config']['name']} preset: validation loss on held-out stdlib files, mean ± std over seeds")
    fig.tight_layout()
    return fig


def plot_ablations(record: dict):
    """Final validation loss of each model (dots: seeds; bar: mean) beside the dense baseline."""
    from .plotting import COLORS, plt

    c = curves(record)
    names = list(c)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    for i, name in enumerate(names):
        cv = c[name]
        ax.bar(i, cv.final, color=COLORS[i % len(COLORS)], alpha=0.5)
        ax.plot([i] * len(cv.finals), cv.finals, "k.", ms=6)
    ax.axhline(c["dense"].final, color="k", lw=0.8, ls=":")
    ax.set_xticks(range(len(names)), names, rotation=20)
    low = min(min(cv.finals) for cv in c.values())
    ax.set_ylim(low - 0.04, max(max(cv.finals) for cv in c.values()) + 0.02)
    ax.set(ylabel="final validation loss", title="final validation loss per model (dots: seeds)")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def load_shares(record: dict, name: str = "MoE", seed: int | None = None) -> torch.Tensor:
    """``(windows, experts)`` share of routed tokens per expert over training, summed over layers."""
    run = next(r for r in record["runs"] if r["name"] == name and (seed is None or r["seed"] == seed))
    load = torch.tensor(run["load"], dtype=torch.float64)
    return load / load.sum(1, keepdim=True)
