"""Input guards of :mod:`labutils.stats` (and of its intervals, :mod:`labutils._stats_intervals`): a dict where
values are expected, non-numbers, NaN and +-inf are refused with the function, the argument and the value named."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping


def _preview(xs, limit: int = 80) -> str:
    text = repr(xs)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _not_a_dict(where: str, arg: str, xs) -> None:
    """THE guard of every public function here that takes values: a dict (any Mapping) is refused, since
    iterating ``{seed: loss}`` gives the seeds, not the losses ("1.000 vs 1.000, inconclusive" over seeds 0, 1, 2)."""
    if isinstance(xs, Mapping):
        raise TypeError(f"{where}: {arg} is a dict ({_preview(xs)}), and iterating a dict gives its keys (the "
                        "seeds?), not its values: pass a sequence of values, e.g. list(d.values())")


def _values(where: str, arg: str, xs) -> list:
    """``xs`` as a list of finite floats, or an error naming ``where``, ``arg`` and the value: a dict, anything
    that is not a sequence of numbers, NaN and +-inf are refused."""
    _not_a_dict(where, arg, xs)
    try:
        out = [float(x) for x in xs]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: {arg}: expected a sequence of numbers, got {_preview(xs)}") from exc
    _finite(where, arg, out)
    return out


def _finite(where: str, arg: str, xs: list) -> None:
    """Refuse a NaN or an infinity among the numbers of ``xs`` (other items, e.g. runs, are not looked at)."""
    bad = [i for i, x in enumerate(xs) if _is_number(x) and not _finite_number(x)]
    if bad:
        raise ValueError(f"{where}: {arg}: every value must be finite, got {[xs[i] for i in bad]} at "
                         f"position(s) {bad} of {_preview(xs)} (a diverged run? leave it out and say so)")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_number(x) -> bool:
    """``x`` converts to a finite float (a Python or numpy number, a one-element tensor)."""
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _real(x) -> bool:
    """``x`` is a finite real number: a Python or numpy number or a one-element tensor, never a bool or a str (a
    "1.3" read from a file would compare as text, ``True`` as 1)."""
    return not isinstance(x, (bool, str, bytes)) and _finite_number(x)


def _level(where: str, level) -> None:
    """The confidence level of an interval: a number strictly between 0 and 1."""
    if not (_real(level) and 0.0 < float(level) < 1.0):
        raise ValueError(f"{where}: level must be a number in (0, 1), e.g. 0.95, got {level!r}")


def _mean_sd(xs: list) -> tuple:
    n = len(xs)
    m = sum(xs) / n if n else float("nan")
    if n < 2:
        return m, float("nan")
    s = max(abs(x - m) for x in xs)
    if s == 0.0 or 1e-150 < s < 1e150:
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    # deviations whose squares would underflow (1e-170: sd 0 for data that vary) or overflow (1e160: an
    # OverflowError): the same sum, over deviations scaled by the largest one
    return m, s * math.sqrt(sum(((x - m) / s) ** 2 for x in xs) / (n - 1))
