"""Chapter 05's study, the runs: every (model, seed) trained with its own batch order and initialisation
(:func:`run_one`), all of them on one or several processes (:func:`run_study`), the training clock without
evaluations (:class:`TrainClock`). (Taught in chapter 05.)
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict

import torch

from labbook.lm_study.config import (
    LOAD_WINDOWS,
    MAIN,
    StudyConfig,
    Variant,
    build,
    optimizer,
    train_flops_per_token,
    variants,
)
from labbook.study import run_jobs
from labutils.data import CharBatches, Corpus, stdlib_file_corpus
from labutils.train import lm_cross_entropy, train


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
                   steps=cfg.steps, optimizer=optimizer(cfg, model), aux_coef=variant.aux_coef,
                   loss_fn=lm_cross_entropy, eval_every=cfg.eval_every, eval_fn=evaluate, progress=False,
                   record_load=bool(variant.experts))
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
    runs = run_jobs(run_one, [(cfg, name, seed) for name, seed in todo], jobs, lambda run: _logged(run, t0, log))
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
