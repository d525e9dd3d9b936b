"""What chapter 05's study (``labbook.lm_study``) and chapter 09's runner (``labbook.train_modern``) share: the one
preset type, the one model builder, the one way to run jobs side by side, the one comparison of arms against a
reference arm (a test from :mod:`labutils.stats`). (Taught in chapters 05 and 09.)
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
from typing import Callable

import torch
from torch import nn

from labutils import stats
from labutils.models import CharLM


class StudyPreset:
    """A study's preset: subclasses are frozen dataclasses whose last field is ``name`` (``"tiny"``, ``"full"``).

    The knobs (every field but ``name``) read as attributes (``cfg.lr``) and as a mapping (``cfg["lr"]``,
    ``**cfg``), so ``labutils.select_preset(**PRESETS)`` takes a study's ``{"tiny": ..., "full": ...}`` as it takes
    a chapter's two dicts, and ``PRESETS[labutils.presets.preset_name()]`` picks the same one."""

    def keys(self) -> list:
        if not dataclasses.is_dataclass(self):
            raise TypeError(f"{type(self).__name__} must be a dataclass (a StudyPreset subclass is one)")
        return [f.name for f in dataclasses.fields(self) if f.name != "name"]

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(f"{type(self).__name__} has no knob {key!r}; knobs: {self.keys()}")
        return getattr(self, key)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def record(self) -> dict:
        """The knobs as a recorded run stores them in JSON (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, self[k]) for k in self.keys())}


def check_seeds(where: str, seeds) -> tuple:
    """``seeds`` as a tuple, after checking it is a non-empty tuple or list of ints (``where``: the call, for the
    message, e.g. ``"StudyConfig(seeds=...)"``)."""
    if not isinstance(seeds, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                       for s in seeds):
        raise TypeError(f"{where}: seeds must be a tuple or list of ints, one run per seed (three seeds: "
                        f"(0, 1, 2), i.e. tuple(range(3))), got {seeds!r}")
    if not seeds:
        raise ValueError(f"{where}: need at least one seed (a tuple or list of ints, e.g. (0, 1)), got {seeds!r}")
    return tuple(seeds)


def build_lm(cfg, ffn: Callable[[], nn.Module], vocab_size: int, seed: int) -> CharLM:
    """Chapter 05's ``CharLM`` with ``ffn()`` as every block's feed-forward, initialised from ``seed``."""
    torch.manual_seed(seed)
    return CharLM(vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.block, ffn)


def run_jobs(fn: Callable, tasks: list, jobs: int, done: Callable | None = None) -> list:
    """``[fn(*task) for task in tasks]``, in the tasks' order. ``jobs == 1``: in this process; more: ``jobs`` fresh
    interpreters (spawn, from a notebook too) side by side. ``done(result)`` is called as each one finishes.
    ``jobs``: an int >= 1, checked before any task runs."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"run_jobs(jobs={jobs!r}): jobs must be an int >= 1 (1: the tasks one after another in "
                         "this process; n: n processes side by side)")
    if jobs == 1:
        out = []
        for task in tasks:
            out.append(fn(*task))
            if done:
                done(out[-1])
        return out
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(fn, *task) for task in tasks]
        if done:
            for future in concurrent.futures.as_completed(futures):
                done(future.result())
        return [future.result() for future in futures]


def versus(arms: dict, reference: str, reference_values: list) -> dict:
    """``{arm: stats.welch(values, reference_values)}`` for every ``arm -> values`` (one value per seed): each arm
    against the reference arm by Welch's t-test (the seeds of two arms are independent runs)."""
    return {name: stats.welch(values, reference_values, names=(name, reference)) for name, values in arms.items()}
