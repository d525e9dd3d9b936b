"""Intervals of :mod:`labutils.stats`: over all seed pairs (:func:`all_pairs`), a percentile bootstrap
(:func:`bootstrap_ci`), a Student-t interval of a mean (:func:`t_interval`), and whether an interval clears a target
(:func:`clears`, :func:`target_verdict`). Import them from :mod:`labutils.stats`."""
from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from ._stats_input import _finite, _finite_number, _level, _mean_sd, _not_a_dict, _preview, _real, _values
from ._student_t import t_ppf


def all_pairs(a_values, b_values, fn) -> list:
    """``fn(a, b)`` for every pair (a from ``a_values``, b from ``b_values``): e.g. the steps dense needs over the
    steps MoE needs, for each dense seed and each MoE seed. Pairs where ``fn`` returns None are left out.
    Refuses (before calling ``fn``) a dict for ``a_values`` or ``b_values`` (pass ``list(d.values())``), either
    not a sequence, and ``fn`` not callable; and, naming the pair, an ``fn`` result that is neither None nor a
    finite number (a NaN would make every mean and interval over the pairs NaN)."""
    args = {}
    for arg, xs in (("a_values", a_values), ("b_values", b_values)):
        _not_a_dict("all_pairs", arg, xs)
        if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
            raise TypeError(f"all_pairs: {arg} must be a sequence (of runs or values), got {_preview(xs)}")
        args[arg] = list(xs)
    if not callable(fn):
        raise TypeError(f"all_pairs: fn must be a function of a pair (a, b), got {_preview(fn)}")
    out = []
    for i, x in enumerate(args["a_values"]):
        for j, y in enumerate(args["b_values"]):
            v: Any = fn(x, y)
            if v is None:
                continue
            if not _real(v):
                raise ValueError(f"all_pairs: fn returned {v!r} for the pair a_values[{i}], b_values[{j}]; it must "
                                 "return a finite number, or None to leave the pair out")
            out.append(float(v))
    return out


def bootstrap_ci(values, stat=None, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of ``stat(sample)`` (default: the mean) resampling ``values`` with
    replacement ``n_boot`` times from a seeded generator: reproducible. ``values`` may be any items (e.g. runs)
    when ``stat`` is given; the default mean needs numbers.

    Refuses (before drawing), naming the argument and the value: a dict (pass ``list(d.values())``), a NaN or
    +-inf among the values (as :func:`welch` does: one diverged run would make the interval NaN and
    :func:`clears` False), non-numbers with the default mean, ``stat`` not callable, fewer than 2 values, ``level``
    outside (0, 1), ``n_boot`` not an int >= 100; and, after drawing, a ``stat`` that returns NaN or +-inf."""
    _not_a_dict("bootstrap_ci", "values", values)
    if stat is not None and not callable(stat):
        raise TypeError(f"bootstrap_ci: stat must be a function of a resample (a list), or None for the mean, got "
                        f"{_preview(stat)}")
    if stat is None:
        vals = _values("bootstrap_ci", "values", values)
    else:
        vals = list(values)
        _finite("bootstrap_ci", "values", vals)
    if len(vals) < 2:
        raise ValueError(f"bootstrap_ci: needs at least 2 values, got {len(vals)}")
    _level("bootstrap_ci", level)
    if not (isinstance(n_boot, int) and not isinstance(n_boot, bool) and n_boot >= 100):
        raise ValueError(f"bootstrap_ci: n_boot must be an int >= 100, got {n_boot!r}")
    stat = stat or (lambda xs: sum(xs) / len(xs))
    rng = random.Random(seed)
    draws: list = [stat([rng.choice(vals) for _ in vals]) for _ in range(n_boot)]
    bad = next((d for d in draws if not _finite_number(d)), None)
    if bad is not None:
        raise ValueError(f"bootstrap_ci: stat returned {bad!r} on a resample; it must return a finite number")
    draws.sort()
    lo_i = int(math.floor((1.0 - level) / 2.0 * n_boot))
    hi_i = int(math.ceil((1.0 + level) / 2.0 * n_boot)) - 1
    return draws[lo_i], draws[min(hi_i, n_boot - 1)]


def t_interval(values, *, n: int | None = None, level: float = 0.95) -> tuple:
    """Student-t interval of the mean of ``values``: mean ± t(1 - (1 - level) / 2, n - 1) · sd / sqrt(n), with sd
    the sample standard deviation of all the values and ``n`` their effective number (default: how many there are).

    Values that share seeds are not independent: the 9 (dense seed, MoE seed) pairs of 3 + 3 seeds hold 3
    independent draws per arm, not 9. Pass ``n`` = the smaller arm's seeds: the variance of the pairs' mean is at
    most the variance of one pair over ``n`` (each seed's effect is averaged over only ``n`` seeds), so the interval
    is conservative.

    Zero spread (every value the same) is deliberately NOT refused, unlike :func:`labutils.stats.welch`'s: the
    interval is the single point ``(v, v)``, whose zero width says itself that the runs showed no spread (a
    speed-up whose every pair reached the loss at the same evaluation, say); :func:`target_verdict` then judges the
    point. A caller whose values are quantised (steps between evaluations) must say so, not read the point as
    certainty. Refuses a dict, NaN or +-inf, fewer than 2 values, ``n`` not an int in [2, len(values)] and
    ``level`` outside (0, 1)."""
    vals = _values("t_interval", "values", values)
    if len(vals) < 2:
        raise ValueError(f"t_interval: needs at least 2 values, got {len(vals)}")
    n = len(vals) if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= len(vals):
        raise ValueError(f"t_interval: n must be an int from 2 to len(values) = {len(vals)}, got {n!r}")
    _level("t_interval", level)
    m, sd = _mean_sd(vals)
    half = t_ppf(1.0 - (1.0 - level) / 2.0, n - 1) * sd / math.sqrt(n)
    return m - half, m + half


def target_verdict(ci: tuple, target: float, higher_is_better: bool = True) -> str:
    """"met" when the whole interval clears the target (:func:`clears`), "NOT met" when the whole interval misses
    it, "inconclusive" when the interval straddles it. Refuses what :func:`clears` refuses."""
    if clears(ci, target, higher_is_better):
        return "met"
    lo, hi = ci
    return "NOT met" if (hi < target if higher_is_better else lo > target) else "inconclusive"


def clears(ci: tuple, target: float, higher_is_better: bool = True) -> bool:
    """Does the whole interval clear the target? "Target met" means this, not a point estimate past it.
    Refuses a ``ci`` that is not a pair of finite numbers (a NaN bound would say "not met" whatever the runs) or
    whose low bound is above its high one (a (high, low) pair would be judged by its high bound), a ``target`` that
    is not a finite number (a str, a bool) and a ``higher_is_better`` that is not a bool."""
    if isinstance(ci, Mapping) or not (isinstance(ci, (tuple, list)) and len(ci) == 2 and all(_real(c) for c in ci)):
        raise ValueError(f"clears: ci must be a (low, high) pair of finite numbers, got {ci!r}")
    if float(ci[0]) > float(ci[1]):
        raise ValueError(f"clears: ci must be a (low, high) pair with low <= high, got {ci!r}: swapped bounds? "
                         f"pass ({ci[1]!r}, {ci[0]!r})")
    if not _real(target):
        raise ValueError(f"clears: target must be a finite number, got {target!r}")
    if not isinstance(higher_is_better, bool):
        raise TypeError(f"clears: higher_is_better must be True or False, got {higher_is_better!r}")
    lo, hi = (float(c) for c in ci)
    return lo >= target if higher_is_better else hi <= target
