"""Chapter 05's checks of the data: the split inspected on the text (:func:`shared_windows`,
:func:`file_coverage`) and repeats of drawing windows with replacement (:func:`window_coverage`). (Taught in
chapter 05.)
"""
from __future__ import annotations

import math

import torch

from labbook.lm_study.config import StudyConfig, epochs
from labutils.data import CharBatches, Corpus


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
