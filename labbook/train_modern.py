"""Chapter 09's experiment runner: one feed-forward variant in chapter 05's CharLM, trained over seeds.
(Taught in chapter 09.)

``run_variant(ffn, corpus, cfg, seeds)`` builds ``CharLM(corpus.vocab_size, cfg.d_model, cfg.n_heads,
cfg.n_layers, cfg.block, ffn)`` per seed, trains it with :func:`labutils.train.train` (Adam, ``cfg.lr``,
``cfg.steps``, batches ``CharBatches(seed=0)`` so every variant sees the same data) and returns validation
curves and what every :class:`~labutils.moe.modern.layer.ModernMoE` layer recorded: load per step, dropped
share, router logit scale (RMS, and the z-loss value ``lse2``). ``aux_coef=1``: the routers' stored losses are
already weighted.
Routers with an auxiliary-loss-free bias are updated before each optimiser step (torchtitan's pre-hook).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from labbook.study import StudyPreset, build_lm, check_seeds, run_jobs, versus
from labutils.data import CharBatches, fixed_windows
from labutils.models import make_ffn
from labutils.moe.modern.aux_free import attach_bias_update
from labutils.moe.modern.layer import ModernMoE
from labutils.train import evaluate_loss, lm_cross_entropy, train


def balance_stats(counts: torch.Tensor) -> tuple[float, float]:
    """``(max/mean, entropy / log E)`` of a ``(E,)`` count vector: 1 and 1 when perfectly balanced."""
    c = counts.double()
    p = c / c.sum().clamp_min(1)
    return float(c.max() / c.mean().clamp_min(1e-12)), float(torch.special.entr(p).sum() / math.log(len(c)))


def per_batch_balance(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts`` ``(steps, E)`` -> per step ``(busiest/mean, quietest/mean)``, each ``(steps,)``.

    ``busiest/mean - 1`` of one batch is DeepSeek's MaxVio_batch (Wang et al. 2024, "Auxiliary-Loss-Free Load
    Balancing", eq. 8 uses the batch's load); summing counts over a window first hides what each batch saw."""
    c = counts.double()
    mean = c.mean(-1).clamp_min(1e-12)                                     # (steps,)
    return c.max(-1).values / mean, c.min(-1).values / mean


def _layer_stats(layers: list[ModernMoE], window: int) -> dict:
    """Per-window load balance (averaged over layers), per-batch balance per step (layer mean), mean dropped
    share, per-step logit RMS (layer mean)."""
    if not layers:
        return {}
    read = [m.read_history() for m in layers]                                     # one host read per layer
    per_layer = [torch.stack([h["counts"] for h in hist]) for hist in read]       # L x (steps, E)
    steps = per_layer[0].shape[0]
    batch = [per_batch_balance(c) for c in per_layer]                             # L x ((steps,), (steps,))
    n = max(1, steps // window)
    mm = torch.zeros(n)
    ent = torch.zeros(n)
    for c in per_layer:
        for w in range(n):
            a, b = balance_stats(c[w * window:(w + 1) * window if w < n - 1 else steps].sum(0))
            mm[w] += a / len(per_layer)
            ent[w] += b / len(per_layer)
    return dict(max_over_mean=mm, entropy=ent,
                batch_max_over_mean=torch.stack([b[0] for b in batch]).mean(0).float(),
                batch_min_over_mean=torch.stack([b[1] for b in batch]).mean(0).float(),
                dropped=sum(h["dropped"] for hist in read for h in hist) / (steps * len(layers)),
                logit_rms=torch.tensor([[h["logit_rms"] for h in hist] for hist in read]).mean(0),
                lse2=torch.tensor([[h["lse2"] for h in hist] for hist in read]).mean(0))


def prefix_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> float:
    """Generation-style held-out loss: position ``t`` is scored from a forward over ``inputs[:, :t+1]`` only.

    ``inputs``/``targets`` ``(B, T)``. A model whose output at ``t`` depends on later tokens (expert choice, or a
    capacity cut that ranks tokens over the whole batch) scores differently here than in one full forward; a
    causal model scores the same up to float rounding."""
    if inputs.dim() != 2 or inputs.shape != targets.shape or inputs.shape[1] == 0:
        raise ValueError(f"prefix_loss needs inputs and targets of one shape (B, T), T >= 1: got "
                         f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for t in range(inputs.shape[1]):
            logits = model(inputs[:, :t + 1])[:, -1:]                      # (B, 1, V)
            total += float(loss_fn(logits, targets[:, t:t + 1]))
    model.train(was_training)
    return total / inputs.shape[1]


def run_variant(ffn: Callable[[], nn.Module], corpus, cfg, seeds=(0, 1), label: str = "", progress: bool = False,
                prefix_eval: bool = False):
    """Train one variant over ``seeds``; returns a dict of per-seed lists (``val``: (evals,) tensors, ``final``:
    the LAST evaluation, ``final_prefix``: the last model scored by :func:`prefix_loss` when ``prefix_eval``,
    ``max_over_mean``/``entropy``: per-window curves, ``batch_max_over_mean``/``batch_min_over_mean``: per-step
    curves of each batch's own load, ``dropped``, ``logit_rms``/``lse2``: per-step curves, ``seconds``) and
    ``val_steps``; ``expert_bias``: per seed, the final auxiliary-loss-free bias of every router that has one,
    concatenated (an empty tensor when none does). ``seeds``: a non-empty tuple or list of ints, checked before
    anything trains."""
    seeds = check_seeds("run_variant(seeds=...)", seeds)
    val_x, val_y = fixed_windows(corpus.val, 64, cfg.block)
    out: dict = {k: [] for k in ("val", "final", "final_prefix", "max_over_mean", "entropy", "batch_max_over_mean",
                                  "batch_min_over_mean", "dropped", "logit_rms", "lse2", "seconds",
                                  "expert_bias")}
    for seed in seeds:
        model = build_lm(cfg, ffn, corpus.vocab_size, seed)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        hook = attach_bias_update(opt, model, allow_none=True)
        r = train(model, CharBatches(corpus.train, cfg.batch, cfg.block, seed=0), steps=cfg.steps, optimizer=opt,
                  loss_fn=lm_cross_entropy, aux_coef=1.0, eval_every=cfg.eval_every, record_load=False,
                  eval_fn=lambda m: evaluate_loss(m, val_x, val_y, lm_cross_entropy), progress=progress,
                  label=f"{label} seed {seed}")
        hook.remove()
        val = torch.tensor([v for _, v in r.val])
        out["val"].append(val)
        out["final"].append(float(val[-1]))
        if prefix_eval:
            out["final_prefix"].append(prefix_loss(model, val_x, val_y, lm_cross_entropy))
        out["seconds"].append(r.seconds)
        found = (getattr(m, "expert_bias", None) for m in model.modules())
        biases = [b.detach().clone() for b in found if isinstance(b, torch.Tensor)]
        out["expert_bias"].append(torch.cat(biases) if biases else torch.zeros(0))
        out["val_steps"] = [s for s, _ in r.val]
        stats = _layer_stats([m for m in model.modules() if isinstance(m, ModernMoE)], max(1, cfg.steps // 10))
        for k, v in stats.items():
            out[k].append(v)
    return out


def _last_tenth(curves: list) -> float:
    """Mean over seeds of each per-step curve's last tenth."""
    return float(torch.stack([c[-max(1, len(c) // 10):].mean() for c in curves]).mean())


def summary_row(res: dict) -> dict:
    """Mean and std over seeds of the final validation loss and the last window's balance numbers."""
    f = torch.tensor(res["final"])
    row = dict(val=float(f.mean()), val_std=float(f.std()) if len(f) > 1 else 0.0,
               seconds=sum(res["seconds"]) / len(res["seconds"]))
    if res.get("final_prefix"):
        fp = torch.tensor(res["final_prefix"])
        row.update(val_prefix=float(fp.mean()), val_prefix_std=float(fp.std()) if len(fp) > 1 else 0.0)
    if res["max_over_mean"]:
        row.update(max_over_mean=float(torch.stack([c[-1] for c in res["max_over_mean"]]).mean()),
                   batch_max_over_mean=_last_tenth(res["batch_max_over_mean"]),
                   batch_min_over_mean=_last_tenth(res["batch_min_over_mean"]),
                   entropy=float(torch.stack([c[-1] for c in res["entropy"]]).mean()),
                   dropped=sum(res["dropped"]) / len(res["dropped"]),
                   logit_rms=_last_tenth(res["logit_rms"]), lse2=_last_tenth(res["lse2"]))
    return row


# --- chapter 09's variants and its recorded full run -------------------------------------------------------

@dataclass(frozen=True)
class ModernConfig(StudyPreset):
    """Chapter 09's knobs (the chapter's table says what each does); a recorded run stores :meth:`record`."""
    d_model: int
    n_heads: int
    n_layers: int
    block: int
    batch: int
    steps: int
    eval_every: int
    seeds: tuple
    lr: float
    bias_rate: float        # the aux-free bias step (DeepSeek-V3: 1e-3)
    name: str = "custom"


PRESETS = {
    "tiny": ModernConfig(d_model=32, n_heads=4, n_layers=1, block=32, batch=16, steps=48, eval_every=16,
                         seeds=(0, 1), lr=6e-3, bias_rate=1e-2, name="tiny"),
    # chapter 05's full-size model (d 64, 2 layers, 64 characters of context), 1000 steps, 3 seeds
    "full": ModernConfig(d_model=64, n_heads=4, n_layers=2, block=64, batch=32, steps=1000, eval_every=250,
                         seeds=(0, 1, 2), lr=3e-3, bias_rate=1e-3, name="full"),
}


def variants(d: int, bias_rate: float) -> dict:
    """Chapter 09's ten feed-forwards at equal active expert width ``4 d`` (grouped-GEMM experts); every MoE
    variant also holds the same total expert parameters, ``8 x 2 d x 2 d`` (fine-grained: 32 experts a quarter as
    wide; shared: one of the eight experts always on, seven routed)."""
    return {
        "dense": lambda: make_ffn("dense", d, 4 * d),
        "top-2/8, no balancing": lambda: ModernMoE(d, 2 * d, 8, 2, impl="grouped"),
        "top-2/8, batch loss": lambda: ModernMoE(d, 2 * d, 8, 2, balance="batch", impl="grouped"),
        "top-2/8, sequence loss": lambda: ModernMoE(d, 2 * d, 8, 2, balance="sequence", impl="grouped"),
        "top-2/8, sigmoid, aux-free": lambda: ModernMoE(d, 2 * d, 8, 2, score_func="sigmoid", route_norm=True,
                                                        bias_rate=bias_rate, impl="grouped"),
        "top-2/8, batch loss + z-loss": lambda: ModernMoE(d, 2 * d, 8, 2, balance="batch", z_coef=1e-3,
                                                          impl="grouped"),
        "fine-grained top-8/32": lambda: ModernMoE(d, d // 2, 32, 8, balance="batch", impl="grouped"),
        # the shared expert is carved out of the routed pool (DeepSeekMoE): 1 + 7 experts, total as top-2/8
        "shared 1 + top-1/7": lambda: ModernMoE(d, 2 * d, 7, 1, n_shared=1, balance="batch", impl="grouped"),
        "expert choice, c=2": lambda: ModernMoE(d, 2 * d, 8, 2, routing="expert", capacity_factor=2.0,
                                                impl="grouped"),
        "top-2/8, dropping cf=1": lambda: ModernMoE(d, 2 * d, 8, 2, balance="batch", capacity_factor=1.0,
                                                    impl="grouped"),
    }


def _record_one(cfg: ModernConfig, name: str) -> dict:
    """In a worker: one variant over the preset's seeds, one thread, reduced to JSON-able numbers."""
    from labutils.data import stdlib_corpus

    torch.set_num_threads(1)
    res = run_variant(variants(cfg.d_model, cfg.bias_rate)[name], stdlib_corpus(), cfg, seeds=cfg.seeds,
                      prefix_eval=True)
    row = summary_row(res)
    out = {"name": name, "row": row, "final": res["final"], "final_prefix": res["final_prefix"],
           "val_steps": res["val_steps"], "val": [v.tolist() for v in res["val"]],
           "val_mean": torch.stack(res["val"]).mean(0).tolist(), "seconds": res["seconds"]}
    if res["max_over_mean"]:
        tenth = max(1, cfg.steps // 10)
        out["balance"] = {      # per seed: windowed (last window) and per batch (mean over the last tenth of steps)
            "window_steps": tenth,
            "window_max_over_mean": [float(c[-1]) for c in res["max_over_mean"]],
            "batch_max_over_mean": [float(c[-tenth:].mean()) for c in res["batch_max_over_mean"]],
            "batch_min_over_mean": [float(c[-tenth:].mean()) for c in res["batch_min_over_mean"]],
            # seed 0's per-step curve over the last tenth (every step: both phases of any oscillation)
            "batch_max_over_mean_seed0_tail": [round(float(x), 4) for x in res["batch_max_over_mean"][0][-tenth:]],
        }
    return out


def record_full(preset: ModernConfig, jobs: int = 2) -> dict:
    """Every variant of ``preset`` over its seeds, ``jobs`` variants side by side (one thread each;
    :func:`labbook.study.run_jobs`)."""
    import time

    names = list(variants(preset.d_model, preset.bias_rate))
    t0 = time.perf_counter()
    done = run_jobs(_record_one, [(preset, name) for name in names], jobs)
    return {"preset": preset.record(), "jobs": jobs, "wall_seconds": time.perf_counter() - t0, "variants": done}


def ranking_lines(record: dict, key: str = "final") -> list:
    """Each variant against the best one (lowest mean of its per-seed ``key`` values, e.g. ``"final"``, the last
    evaluation), judged by Welch's t-test over seeds (:func:`labutils.stats.welch`, alpha 0.05)."""
    rows = sorted(record["variants"], key=lambda v: sum(v[key]) / len(v[key]))
    if not rows:
        raise ValueError("the record holds no variant to rank")
    best = rows[0]
    against_best = versus({v["name"]: v[key] for v in rows}, best["name"], best[key])
    lines = []
    for v in rows:
        c = against_best[v["name"]]
        sd = 0.0 if math.isnan(c.sd_a) else c.sd_a
        word = ("best" if v is best else f"behind the best (Welch p = {c.p:.3g})" if c.verdict == "behind"
                else f"not distinguishable from the best (p = {c.p:.3g})")
        lines.append(f"{v['name']:<30} {c.mean_a:.4f} ± {sd:.4f}   {c.diff:+.4f}  {word}")
    return lines


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values, ``{name: p} -> {name: adjusted p}``: sorted
    ascending, the ``i``-th smallest (from 1) is multiplied by ``m - i + 1``, capped at 1, and made non-decreasing
    along the order. Reject a hypothesis at ``alpha`` when its adjusted p is below ``alpha``; the family-wise
    error rate is then at most ``alpha`` (Holm 1979). NaN p-values (an arm too small to test) stay NaN and are
    not counted in ``m``. (``labutils.stats`` has no multiple-comparison correction; this is chapter 09's.)"""
    tested = sorted((p, n) for n, p in pvalues.items() if not math.isnan(p))
    m, out, running = len(tested), {n: float("nan") for n in pvalues}, 0.0
    for i, (p, n) in enumerate(tested):
        running = max(running, min(1.0, (m - i) * p))
        out[n] = running
    return out


CAUSAL_TOL = 1e-4  # nats: a variant whose prefix evaluation differs more than this saw later tokens


def dense_verdicts(record: dict, tol: float = CAUSAL_TOL) -> dict:
    """Every MoE variant of a full record against dense by Welch's t-test (:func:`labutils.stats.welch`) on the
    last evaluation, Holm-corrected over the family of these comparisons (:func:`holm`: the Comparison's ``p`` is
    the adjusted p, its ``test`` says so, and its verdict is "inconclusive" unless the adjusted p is below
    ``alpha``), ``name -> (Comparison, basis, causal)``: a variant is causal when its generation-style
    (prefix) evaluation matches its full-forward one within ``tol`` on every seed; a leaky one (expert choice, a
    capacity cut) is judged on its prefix evaluation, as it would generate. Needs ``final`` and
    ``final_prefix`` per variant (records from ``benchmarks/modern_moe.py`` since the prefix evaluation)."""
    by = {v["name"]: v for v in record["variants"]}
    missing = [n for n, v in by.items() if not v.get("final_prefix")]
    if "dense" not in by or missing:
        raise ValueError(f"dense_verdicts needs a dense run and every variant's final_prefix; missing: {missing}")
    causal = {n: max(abs(a - b) for a, b in zip(v["final"], v["final_prefix"])) < tol
              for n, v in by.items() if n != "dense"}
    basis = {n: "final" if c else "final_prefix" for n, c in causal.items()}
    raw = versus({n: by[n][basis[n]] for n in causal}, "dense", by["dense"]["final"])
    adjusted = holm({n: c.p for n, c in raw.items()})
    comparisons = {n: dataclasses.replace(c, p=adjusted[n], test=f"{c.test} (p Holm-adjusted over {len(raw)})",
                                          verdict=c.verdict if adjusted[n] < c.alpha else "inconclusive")
                   for n, c in raw.items()}
    return {n: (comparisons[n], basis[n], causal[n]) for n in causal}
