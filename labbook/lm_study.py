"""Chapter 05's study: MoE against dense on real text at equal active parameters, over seeds. (Chapter 05.)

Three models differ only in their feed-forward (:func:`variants`):

* ``dense``: an MLP of hidden width ``4 d``;
* ``MoE``: ``E`` experts of width ``4 d / k``, top-``k`` noisy gating: the same active parameters per token
  as ``dense`` (plus the router), ``E / k`` times its feed-forward parameters;
* ``dense-wide``: one MLP of width ``4 d E / k``, MoE's total parameters and ``E / k`` times the compute.

``dense-wide`` is the regime check: if it does not beat ``dense`` clearly, the runs are data- or step-limited
and no amount of extra parameters (MoE's included) can show. Ablations change one MoE knob at a time, on every
seed; ``E=k=2`` is a gated dense model (every token through both experts: MoE's FLOPs, dense's parameters), and
:func:`data_limited` is the same study on a small slice of the training text, seen for several epochs.

:func:`run_study` trains every (model, seed), optionally on several processes; :func:`summarize` reduces the
record to verdicts, every one a test from :mod:`labutils.stats`; :func:`verdict_lines` writes the summary text
*from those numbers*. ``benchmarks/moe_vs_dense.py`` records the ``full`` preset; the chapter runs ``tiny`` and
shows the recorded ``full`` run. Each run's batch order and initialisation come from its seed. The checks the
chapter makes of the setup live here too: FLOPs measured by ``FlopCounterMode`` (:func:`measured_train_flops`),
the split inspected on the data (:func:`shared_windows`), repeats of drawing windows with replacement
(:func:`window_coverage`), the training clock without evaluations (:class:`TrainClock`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import multiprocessing
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from labutils import stats
from labutils.data import CharBatches, Corpus, stdlib_file_corpus
from labutils.models import CharLM, make_ffn
from labutils.train import lm_cross_entropy, train

MAIN = ("dense", "MoE", "dense-wide")
ABLATIONS = ("top-1", "top-1 Switch", "E=4", "E=16", "no balance loss", "E=k=2")
LOAD_WINDOWS = 40  # training loss and expert load are kept as means/sums over this many windows of steps


@dataclass(frozen=True)
class StudyConfig:
    """One study: model shape, training length, seeds, and which ablations run (on every seed)."""
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
    ablations: tuple = ABLATIONS
    val_one_in: int = 25        # one stdlib file in this many is held out
    val_tokens: int = 0         # 0: the whole held-out set; n: its first n characters (tiny preset only)
    threads: int = 1            # torch threads per run
    train_chars: int = 0        # 0: the whole training split; n: its first n characters (the data-limited control)
    control_chars: int = 1_000_000  # training characters of the data-limited control (:func:`data_limited`)
    name: str = "custom"

    def __post_init__(self):
        # num_expert=0 would build the "MoE" row as a dense feed-forward and record it under the name MoE
        for what, value, low in (("num_expert", self.num_expert, 2), ("top_k", self.top_k, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StudyConfig({what}=...): must be an int >= {low}, got {value!r} (an MoE routes "
                                 "each token to top_k of num_expert >= 2 experts; the dense baselines are built "
                                 "from d_model)")
        if self.top_k > self.num_expert:
            raise ValueError(f"StudyConfig(top_k=...): must be between 1 and num_expert={self.num_expert}, got "
                             f"{self.top_k!r}")


PRESETS = {
    "tiny": StudyConfig(d_model=32, block=32, batch=16, steps=150, eval_every=30, seeds=(0, 1),
                        ablations=("top-1 Switch", "E=k=2"), lr=5e-3, val_tokens=32_768, control_chars=16_384,
                        name="tiny"),
    "full": StudyConfig(name="full"),
}


@dataclass(frozen=True)
class Variant:
    """A feed-forward: ``hidden`` is per expert for MoE (``experts`` > 0). ``gate``: ``"noisy"`` (fastmoe's
    ``NoisyGate``: the chosen experts weighted by a softmax over the top-k logits only, so at k = 1 the task gives
    the router no gradient) or ``"switch"`` (``SwitchGate``: top-1 weighted by the full softmax probability, the
    router trained through it; capacity factor 1.2 in training, 2.4 in evaluation, tokens over it dropped)."""
    hidden: int
    experts: int = 0
    top_k: int = 0
    aux_coef: float = 0.0
    gate: str = "noisy"

    def ffn(self, d: int):
        if not self.experts:
            return make_ffn("dense", d, self.hidden)
        from labutils.moe import NoisyGate, SwitchGate
        gates = {"noisy": NoisyGate, "switch": SwitchGate}
        if self.gate not in gates:
            raise ValueError(f"Variant.gate must be one of {sorted(gates)}, got {self.gate!r}")
        return make_ffn("fmoe", d, self.hidden, num_expert=self.experts, top_k=self.top_k, gate=gates[self.gate])

    @property
    def router_matmuls(self) -> int:
        """``(d, E)`` matmuls per token in the router: NoisyGate has clean and noise logits, SwitchGate one."""
        return 0 if not self.experts else 2 if self.gate == "noisy" else 1


def variants(cfg: StudyConfig) -> dict:
    """The three main models and the ablations, every MoE at the dense model's active feed-forward width."""
    d, E, k = cfg.d_model, cfg.num_expert, cfg.top_k
    table = {
        "dense": Variant(4 * d),
        "MoE": Variant(4 * d // k, E, k, cfg.aux_coef),
        "dense-wide": Variant(4 * d * E // k),
        "top-1": Variant(4 * d, E, 1, cfg.aux_coef),              # same active width, twice the experts' params
        "top-1 Switch": Variant(4 * d, E, 1, cfg.aux_coef, gate="switch"),  # the router trained by the task
        "E=4": Variant(4 * d // k, 4, k, cfg.aux_coef),
        "E=16": Variant(4 * d // k, 16, k, cfg.aux_coef),
        "no balance loss": Variant(4 * d // k, E, k, 0.0),
        "E=k=2": Variant(4 * d // 2, 2, 2, cfg.aux_coef),          # gated dense: MoE's FLOPs, dense's params
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
    of ``NoisyGate`` is two ``(d, E)`` matmuls (clean and noise logits), ``SwitchGate``'s one. Attention scores
    count the whole ``T x T`` square (the causal mask does not skip work). :func:`measured_train_flops` checks it."""
    d, T = cfg.d_model, cfg.block
    active_ffn = 2 * d * variant.hidden * max(1, variant.top_k) + variant.router_matmuls * d * variant.experts
    attention = 4 * d * d + 2 * T * d                                                  # projections + scores
    forward = 2 * (cfg.n_layers * (active_ffn + attention) + d * vocab_size)
    return 3 * forward


def measured_train_flops(cfg: StudyConfig, variant: Variant, vocab_size: int, seed: int = 0) -> int:
    """FLOPs of one training step (forward + backward of a ``(batch, block)`` batch) counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on the real model. Attention runs on SDPA's math backend here:
    the counter has no formula for the fused CPU kernel, and the math path does the same ``T x T`` products."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build(cfg, variant, vocab_size, seed)
    x = torch.randint(vocab_size, (cfg.batch, cfg.block), generator=torch.Generator().manual_seed(seed))  # (B, T)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_cross_entropy(model(x), x).backward()
    return int(counter.get_total_flops())


def data_limited(cfg: StudyConfig) -> StudyConfig:
    """The regime control: the main models on the first ``cfg.control_chars`` training characters, the same
    steps (so several epochs), no ablations."""
    return dataclasses.replace(cfg, train_chars=cfg.control_chars, ablations=(), name=f"{cfg.name} data-limited")


def epochs(cfg: StudyConfig, train_chars: int) -> float:
    """Characters drawn over the run (``steps x batch x block``) divided by the training characters."""
    return cfg.steps * cfg.batch * cfg.block / train_chars


def window_coverage(cfg: StudyConfig, train_chars: int, seed: int) -> dict:
    """How often each training character is seen by the run's real batch stream (``CharBatches`` with the run's
    seed, replayed on positions instead of text): windows are drawn **with replacement**, so some characters are
    seen twice or more long before one epoch. Returns the share of characters seen at least once, the share of
    the seen ones seen twice or more, and the same share expected if each character's count were Poisson."""
    stream = CharBatches(torch.arange(train_chars), cfg.batch, cfg.block, seed=seed)
    edges = torch.zeros(train_chars + 1, dtype=torch.long)                # (N + 1,)
    for _ in range(cfg.steps):
        x, _ = stream.next_batch()                                        # (B, T) positions
        starts = x[:, 0]                                                  # (B,)
        edges.index_add_(0, starts, torch.ones_like(starts))
        edges.index_add_(0, starts + cfg.block + 1, -torch.ones_like(starts))  # a window covers T + 1 characters
    count = edges.cumsum(0)[:-1]                                          # (N,) times each character was drawn
    seen = int((count >= 1).sum())
    lam = cfg.steps * cfg.batch * (cfg.block + 1) / (train_chars - cfg.block)
    return {"seen_share": seen / train_chars, "twice_share": int((count >= 2).sum()) / max(seen, 1),
            "poisson_twice_share": (1 - math.exp(-lam) - lam * math.exp(-lam)) / (1 - math.exp(-lam)),
            "epochs": epochs(cfg, train_chars)}


_HASH_BASE = 1_000_003


def _wrap64(x: int) -> int:
    """A Python int as the signed 64-bit value with the same low 64 bits (what int64 arithmetic wraps to)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _window_hashes(ids: torch.Tensor, width: int) -> torch.Tensor:
    """A 64-bit polynomial hash of every window of ``width`` ids: ``(N - width + 1,)`` int64 (wrapping), built by
    doubling (a window's hash from its two halves): log2(width) passes over the text, not ``width``."""
    h, w = ids.long(), 1                                               # (N,) hashes of windows of width 1
    while w < width:
        h = h[:-w] * _wrap64(_HASH_BASE ** w) + h[w:]                  # (N - 2w + 1,) windows of width 2w
        w *= 2
    return h


def shared_windows(train: torch.Tensor, val: torch.Tensor, width: int = 64) -> torch.Tensor:
    """``(N_val,)`` bool: which validation characters lie inside a ``width``-character window that also occurs,
    character for character, somewhere in ``train`` (by 64-bit hash of every window; a collision is about
    N / 2^64 likely). A validation file copied into training is covered whole; shared idioms and near-twin
    files cover parts. ``width``: a power of two."""
    if not (isinstance(width, int) and width >= 2 and width & (width - 1) == 0):
        raise ValueError(f"shared_windows: width must be a power of two >= 2, got {width!r}")
    if len(val) < width or len(train) < width:
        raise ValueError(f"shared_windows: width={width} needs at least {width} characters on each side, got "
                         f"train {len(train)}, val {len(val)}")
    table = torch.sort(_window_hashes(train, width)).values            # (N_train - width + 1,)
    want = _window_hashes(val, width)                                  # (N_val - width + 1,)
    found = table[torch.searchsorted(table, want).clamp_max(len(table) - 1)] == want
    edges = torch.zeros(len(val) + 1, dtype=torch.long)
    starts = found.nonzero().flatten()
    edges.index_add_(0, starts, torch.ones_like(starts))
    edges.index_add_(0, starts + width, -torch.ones_like(starts))
    return edges.cumsum(0)[:-1] > 0


def file_coverage(corpus: Corpus, covered: torch.Tensor, files: list) -> dict:
    """``{file: (characters, share covered)}`` for the validation ``files``, cut out of ``corpus.val`` at the
    ``# ---- path ----`` line that starts each file's text."""
    text = corpus.decode(corpus.val) if len(corpus.val) < 5_000_000 else ""
    starts = [(text.find(f"# ---- {f} ----\n"), f) for f in files]
    missing = [f for pos, f in starts if pos < 0]
    if missing:
        raise ValueError(f"file_coverage: {len(missing)} file(s) not in the validation text, e.g. {missing[0]!r}")
    starts.sort()
    bounds = [pos for pos, _ in starts] + [len(text)]
    return {f: (bounds[i + 1] - pos, float(covered[pos: bounds[i + 1]].float().mean()))
            for i, (pos, f) in enumerate(starts)}


class TrainClock:
    """Training time with evaluations left out: :meth:`eval_start` returns (and records) the training seconds so
    far, :meth:`eval_end` adds the evaluation's duration to what is subtracted. ``clock`` is the time source: by
    default the process's CPU seconds (``time.process_time``), so a run that shares its core with other work is
    charged for its own computation, not for the time it waited."""

    def __init__(self, clock=time.process_time):
        self.clock, self.t0, self.eval_seconds, self.train_seconds = clock, clock(), 0.0, []
        self._started = None

    def eval_start(self) -> float:
        self._started = self.clock()
        self.train_seconds.append(self._started - self.t0 - self.eval_seconds)
        return self.train_seconds[-1]

    def eval_end(self) -> None:
        if self._started is None:
            raise RuntimeError("TrainClock.eval_end() without eval_start()")
        self.eval_seconds += self.clock() - self._started
        self._started = None


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


def training_text(cfg: StudyConfig, corpus: Corpus) -> torch.Tensor:
    """The training ids a run draws from: the whole split, or its first ``cfg.train_chars`` characters."""
    if cfg.train_chars and cfg.train_chars <= cfg.block:
        raise ValueError(f"train_chars={cfg.train_chars} must exceed block={cfg.block} (or be 0: the whole split)")
    return corpus.train[: cfg.train_chars] if cfg.train_chars else corpus.train


def _run_one(cfg: StudyConfig, name: str, seed: int) -> dict:
    corpus = corpus_for(cfg.val_one_in)
    val = corpus.val[: cfg.val_tokens] if cfg.val_tokens else corpus.val
    variant = variants(cfg)[name]
    _warm_up(cfg, variant, corpus.vocab_size)  # first-call costs (allocations, kernels) stay off the clock
    model = build(cfg, variant, corpus.vocab_size, seed)
    clock = TrainClock()

    def evaluate(m):
        clock.eval_start()                     # training time so far, evaluations excluded
        try:
            return heldout_loss(m, val, cfg.block)
        finally:
            clock.eval_end()

    result = train(model, CharBatches(training_text(cfg, corpus), cfg.batch, cfg.block, seed=seed),
                   steps=cfg.steps, lr=cfg.lr, aux_coef=variant.aux_coef, loss_fn=lm_cross_entropy,
                   eval_every=cfg.eval_every, eval_fn=evaluate, progress=False, record_load=bool(variant.experts))
    total = sum(p.numel() for p in model.parameters())
    window = max(1, cfg.steps // LOAD_WINDOWS)
    n = cfg.steps // window * window
    losses = torch.tensor(result.losses[:n]).view(-1, window).mean(1)                     # (windows,)
    layers = []
    if variant.experts:
        per_step = torch.stack(result.load[:n])                                           # (steps, layers, E)
        layers = per_step.view(-1, window, *per_step.shape[1:]).sum(1).tolist()            # (windows, layers, E)
    return {"name": name, "seed": seed, "val_steps": [s for s, _ in result.val], "val": [v for _, v in result.val],
            "train_seconds": clock.train_seconds, "eval_seconds": clock.eval_seconds, "window": window,
            "clock": getattr(clock.clock, "__name__", "custom"),
            "train_loss": losses.tolist(),
            "flops_per_step": train_flops_per_token(cfg, variant, corpus.vocab_size) * cfg.batch * cfg.block,
            "params": total, "load_layers": layers, "variant": asdict(variant)}


def run_study(cfg: StudyConfig, jobs: int = 1, log=print) -> dict:
    """Every main model on every seed, then each ablation on every seed; ``jobs`` processes at a time."""
    if not cfg.seeds or isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"need at least one seed and jobs >= 1, got seeds={cfg.seeds!r}, jobs={jobs!r}")
    variants(cfg)  # unknown ablations fail here, before any process starts
    corpus = corpus_for(cfg.val_one_in)
    training_text(cfg, corpus)  # a bad train_chars fails here too
    todo = [(name, seed) for seed in cfg.seeds for name in MAIN] + [(a, s) for a in cfg.ablations for s in cfg.seeds]
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
                                              "val_used": cfg.val_tokens or len(corpus.val),
                                              "train_used": cfg.train_chars or len(corpus.train)},
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


def _runs(record: dict, name: str) -> list:
    return [r for r in record["runs"] if r["name"] == name]


def _finals(record: dict, name: str) -> list:
    return [r["val"][-1] for r in _runs(record, name)]


def seed_bootstrap(a_runs: list, b_runs: list, fn, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """``fn(a, b)`` over every (a, b) pair of runs (``stats.all_pairs``), its mean, and a 95% bootstrap interval of
    that mean that resamples the seeds of **each arm** independently (``stats.bootstrap_ci`` resamples ``a``'s
    seeds; the statistic redraws ``b``'s from its own seeded generator). ``reached``: pairs where ``fn`` is not
    None, of ``pairs``."""
    values = stats.all_pairs(a_runs, b_runs, fn)
    out = {"values": values, "pairs": len(a_runs) * len(b_runs), "reached": len(values),
           "seeds": (len(a_runs), len(b_runs)),
           "mean": statistics.fmean(values) if values else None, "ci": None}
    if len(values) == out["pairs"] and len(a_runs) > 1 and len(b_runs) > 1:
        import random
        rng = random.Random(seed + 1)

        def mean_over_pairs(a_sample):
            b_sample = [rng.choice(b_runs) for _ in b_runs]
            return statistics.fmean(stats.all_pairs(a_sample, b_sample, fn))

        out["ci"] = stats.bootstrap_ci(a_runs, mean_over_pairs, n_boot=n_boot, seed=seed)
    return out


def _steps_ratio(dense_run: dict, moe_run: dict) -> float | None:
    reach = steps_to_reach(moe_run["val_steps"], moe_run["val"], dense_run["val"][-1])
    return dense_run["val_steps"][-1] / reach if reach else None


def _time_ratio(dense_run: dict, moe_run: dict) -> float | None:
    reach = steps_to_reach(moe_run["train_seconds"], moe_run["val"], dense_run["val"][-1])
    return dense_run["train_seconds"][-1] / reach if reach else None


def summarize(record: dict, target_speedup: float = 1.3) -> dict:
    """The verdicts, each a test from :mod:`labutils.stats` on the record's final validation losses (Welch: the
    seeds of two models are independent runs): MoE vs dense, MoE vs dense-wide, dense-wide vs dense (the regime
    check), the steps speed-up over all seed pairs with a bootstrap interval, and the same at equal CPU time."""
    c = curves(record)
    missing = [name for name in MAIN if name not in c]
    if missing:
        raise ValueError(f"the record has no run of {missing}: summarize compares {list(MAIN)}")
    f = {n: _finals(record, n) for n in MAIN}
    dense_runs, moe_runs = _runs(record, "dense"), _runs(record, "MoE")
    # equal CPU time: every dense and MoE run at the shortest of their training times, each interpolated
    t_eq = min(r["train_seconds"][-1] for r in dense_runs + moe_runs)
    at_t = {n: [loss_at(r["train_seconds"], r["val"], t_eq) for r in _runs(record, n)] for n in ("dense", "MoE")}
    unreached = sum(v is None for vals in at_t.values() for v in vals)
    eq = (stats.welch([v for v in at_t["MoE"] if v is not None], [v for v in at_t["dense"] if v is not None],
                      names=("MoE", "dense")) if not unreached else None)
    flops = {n: _runs(record, n)[0]["flops_per_step"] for n in MAIN}
    return {
        "preset": record["config"]["name"],
        "final": {name: (cv.final, cv.final_std, len(cv.finals)) for name, cv in c.items()},
        "seeds": {n: len(v) for n, v in f.items()},
        "moe_vs_dense": stats.welch(f["MoE"], f["dense"], names=("MoE", "dense")),
        "moe_vs_wide": stats.welch(f["MoE"], f["dense-wide"], names=("MoE", "dense-wide")),
        "wide_vs_dense": stats.welch(f["dense-wide"], f["dense"], names=("dense-wide", "dense")),
        "flops_ratio": {n: flops[n] / flops["dense"] for n in MAIN},
        "speedup": seed_bootstrap(dense_runs, moe_runs, _steps_ratio), "target_speedup": target_speedup,
        "equal_time": {"seconds": t_eq, "comparison": eq, "unreached": unreached,
                       "time_ratio": seed_bootstrap(dense_runs, moe_runs, _time_ratio),
                       "train_seconds": {n: c[n].seconds[-1] for n in MAIN},
                       "jobs": record.get("jobs", 1), "threads": record["config"].get("threads", 1),
                       "clock": dense_runs[0].get("clock", "perf_counter")},
    }


def target_met(boot: dict, target: float) -> bool:
    """"Target met" only when every seed pair reached the loss, each arm has 3 seeds or more (the rule of
    ``stats``' verdicts) and the bootstrap interval's lower bound clears ``target``."""
    return bool(boot["ci"] is not None and boot["reached"] == boot["pairs"] and min(boot["seeds"]) >= 3
                and stats.clears(boot["ci"], target))


def _ratio_sentence(what: str, boot: dict, target: float | None) -> str:
    if not boot["values"]:
        return f"{what}: no MoE seed reached dense's final loss"
    line = (f"{what}: {boot['mean']:.2f}× on average over {boot['reached']} of {boot['pairs']} (dense seed, MoE "
            f"seed) pairs that reached it (pairs range {min(boot['values']):.2f}–{max(boot['values']):.2f}")
    line += (f"; 95% bootstrap interval [{boot['ci'][0]:.2f}, {boot['ci'][1]:.2f}], seeds of each arm resampled)"
             if boot["ci"] is not None else "; no interval: every pair must reach it, with 2 seeds or more per arm)")
    if target is not None:
        line += f"; target ≥ {target}: " + ("met (the interval's lower bound clears it)" if target_met(boot, target)
                                             else "NOT met (met only when the interval's lower bound clears it, "
                                                  "with every pair reaching and 3 seeds or more per arm)")
    return line


def verdict_lines(summary: dict, target_speedup: float | None = None) -> list:
    """The chapter's verdicts, written from the numbers (never in advance), naming the preset."""
    s, preset = summary, summary["preset"]
    target = s["target_speedup"] if target_speedup is None else target_speedup
    lines = [f"{name:<16} final validation loss {m:.4f} " + (f"± {sd:.4f} (seed std, {n} seeds)" if n > 1
                                                             else "(one seed)")
             for name, (m, sd, n) in s["final"].items()]
    w = s["wide_vs_dense"]
    lines.append("regime check: " + w.sentence("nats", preset) + ": " + (
        "extra parameters help here (capacity-limited), so MoE's extra parameters can show"
        if w.verdict == "ahead" else "NOT shown that extra parameters help here, so MoE cannot be expected to"))
    lines.append(s["moe_vs_dense"].sentence("nats", preset))
    mw = s["moe_vs_wide"]
    gain_wide = s["final"]["dense"][0] - s["final"]["dense-wide"][0]
    share = (s["final"]["dense"][0] - s["final"]["MoE"][0]) / gain_wide if gain_wide > 0 else None
    cost = s["flops_ratio"]["MoE"] / s["flops_ratio"]["dense-wide"]
    lines.append(mw.sentence("nats", preset) + (
        f"; MoE has {share:.0%} of dense-wide's gain over dense at {cost:.0%} of its FLOPs per step"
        if share is not None else ""))
    lines.append(_ratio_sentence("steps for dense / steps for MoE to reach dense's final loss", s["speedup"], target))
    e = s["equal_time"]
    what = "CPU seconds of each process" if e.get("clock") == "process_time" else "wall-clock seconds"
    how = (f"{e['jobs']} run(s) side by side, {e['threads']} thread each; training clocks count {what} and "
           f"exclude evaluations")
    if e["comparison"] is None:
        lines.append(f"at equal CPU time ({e['seconds']:.0f} s of training): {e['unreached']} run(s) had no "
                     f"evaluation by then: no verdict ({how})")
    else:
        lines.append(f"at equal CPU time ({e['seconds']:.0f} s of training, the shortest run's; {how}): "
                     + e["comparison"].sentence("nats", preset))
    lines.append(_ratio_sentence("training seconds for dense / for MoE to reach dense's final loss",
                                 e["time_ratio"], None))
    return lines


def loss_at(xs: list, ys: list, x: float) -> float | None:
    """The curve's value at ``x`` (linear between points), None before its first point."""
    if x < xs[0]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] if x == xs[-1] else None


def ablation_comparisons(record: dict) -> dict:
    """``{ablation: stats.welch(its final losses, MoE's)}`` over all seeds of each (fewer than 3: inconclusive)."""
    moe = _finals(record, "MoE")
    return {name: stats.welch(_finals(record, name), moe, names=(name, "MoE"))
            for name in dict.fromkeys(r["name"] for r in record["runs"]) if name not in MAIN}


def ablation_lines(record: dict) -> list:
    """Each ablation against the MoE mean by Welch's test, as generated sentences naming the preset."""
    return [c.sentence("nats", record["config"]["name"]) for c in ablation_comparisons(record).values()]


# --- figures ---------------------------------------------------------------------------------------------


def plot_study(record: dict):
    """Validation loss (mean ± std over seeds, as a band) against steps, training FLOPs and CPU seconds."""
    from labutils.plotting import COLORS, plt

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
    low = min(min(c[n].mean) for n in MAIN)
    axes[0].set_ylim(low - 0.05, min(c["dense"].mean[0], low + 1.0))
    fig.suptitle(f"{record['config']['name']} preset: validation loss on held-out stdlib files, mean ± std over seeds")
    fig.tight_layout()
    return fig


def plot_ablations(record: dict):
    """Final validation loss of each model as its mean with a 95% t-interval (seeds as dots); a model with one
    seed has no interval and is drawn hollow. The y axis starts at zero."""
    from labutils.plotting import COLORS, plt

    c = curves(record)
    names = list(c)
    fig, ax = plt.subplots(figsize=(9, 3.4), dpi=100)
    for i, name in enumerate(names):
        cv, color = c[name], COLORS[i % len(COLORS)]
        n = len(cv.finals)
        ax.plot([i] * n, cv.finals, ".", color="0.4", ms=5)
        if n > 1:
            half = stats.t_ppf(0.975, n - 1) * cv.final_std / math.sqrt(n)
            ax.errorbar(i, cv.final, yerr=half, fmt="o", color=color, capsize=4, ms=7)
        else:
            ax.plot(i, cv.final, "o", mfc="none", color=color, ms=7)
    ax.axhline(c["dense"].final, color="k", lw=0.8, ls=":", label="dense mean")
    ax.set_xticks(range(len(names)), [f"{n}\n({len(c[n].finals)} seed{'s' if len(c[n].finals) > 1 else ''})"
                                      for n in names], fontsize=8)
    ax.set_ylim(0, max(max(cv.finals) for cv in c.values()) * 1.08)
    ax.set(ylabel="final validation loss (nats)",
           title=f"{record['config']['name']} preset: final loss, mean with 95% t-interval (dots: seeds)")
    ax.legend(frameon=False, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def _run(record: dict, name: str, seed: int | None):
    for r in record["runs"]:
        if r["name"] == name and (seed is None or r["seed"] == seed):
            return r
    raise ValueError(f"the record has no run of {name!r}" + (f" with seed {seed}" if seed is not None else ""))


def load_shares(record: dict, name: str = "MoE", seed: int | None = None, layer: int | None = None) -> torch.Tensor:
    """``(windows, experts)`` share of routed tokens per expert over training: one ``layer``, or summed over layers
    (None). A record made before per-layer load (key ``load``) has only the sum."""
    run = _run(record, name, seed)
    if "load_layers" in run:
        load = torch.tensor(run["load_layers"], dtype=torch.float64)           # (windows, layers, experts)
        load = load.sum(1) if layer is None else load[:, layer]
    elif layer is None:
        load = torch.tensor(run["load"], dtype=torch.float64)                  # (windows, experts)
    else:
        raise ValueError(f"this record's {name!r} run has its load summed over layers only (no 'load_layers')")
    return load / load.sum(1, keepdim=True)


def plot_layer_load(record: dict, name: str = "MoE", seed: int | None = None):
    """Each MoE layer's share of routed tokens per expert over training, one heatmap per layer (a collapse in
    one layer cannot hide in the sum)."""
    from labutils.plotting import plt

    run = _run(record, name, seed)
    n_layers = len(run["load_layers"][0])
    fig, axes = plt.subplots(1, n_layers, figsize=(4.2 * n_layers, 3.2), dpi=100, squeeze=False)
    for layer, ax in enumerate(axes[0]):
        share = load_shares(record, name, run["seed"], layer)                  # (windows, experts)
        im = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
        ax.set(title=f"layer {layer}", xlabel="expert", ylabel=f"training window ({run['window']} steps)")
        fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.suptitle(f"{record['config']['name']} preset, {name} seed {run['seed']}: load per layer")
    fig.tight_layout()
    return fig


def busiest_over_mean(record: dict, name: str = "MoE", last: float = 0.2) -> list:
    """Per run of ``name`` (seeds in order) and per layer: the busiest expert's share over the balanced share,
    over the last ``last`` fraction of training windows."""
    out = []
    for r in _runs(record, name):
        load = torch.tensor(r["load_layers"], dtype=torch.float64)             # (windows, layers, experts)
        tail = load[-max(1, int(len(load) * last)):].sum(0)                   # (layers, experts)
        out.append((tail.max(1).values / tail.mean(1)).tolist())
    return out
