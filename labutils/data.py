"""Batch streams for chapters 03-05: random regression pairs, a fixed dataset by epochs, and characters of real text.

Every stream has ``next_batch() -> (inputs, targets)`` and ``state_dict()`` / ``load_state_dict()`` so the
trainer (``labutils.train``) can checkpoint the data position and resume bit-exactly. Each stream draws from
its own ``torch.Generator``, never the global RNG, so model-side randomness cannot shift the data.

The text corpus is the Python standard library's own source (:func:`stdlib_corpus`): real, structured text
that every Python installation already has, so nothing is downloaded. Its bytes depend on the Python
version (3.11.7 for the committed outputs); :func:`stdlib_corpus` reports a SHA-256 so a run can say which.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

# A fixed, sorted list of pure-Python stdlib modules (about 1.1 MB on Python 3.11).
STDLIB_FILES = ("argparse.py", "ast.py", "calendar.py", "configparser.py", "copy.py", "csv.py", "dataclasses.py",
                "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "inspect.py", "pathlib.py",
                "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py", "textwrap.py", "threading.py",
                "typing.py")


class RandomPairs:
    """An endless stream of independent N(0, 1) ``(x, y)`` of shape ``(batch, T, d)``: the book's random data."""

    def __init__(self, batch: int, T: int, d: int, seed: int = 0):
        self.shape = (batch, T, d)
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next_batch(self):
        x = torch.randn(self.shape, generator=self.gen)  # (B, T, d)
        y = torch.randn(self.shape, generator=self.gen)  # (B, T, d)
        self.position += 1
        return x, y

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.position = int(state["position"])


class EpochBatches:
    """A fixed dataset ``(x, y)`` cut into minibatches, reshuffled every epoch (``drop_last``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if len(x) != len(y):
            raise ValueError(f"x and y have different lengths {len(x)} and {len(y)}")
        if batch_size > len(x):
            raise ValueError(f"batch_size={batch_size} exceeds the {len(x)} samples")
        self.x, self.y, self.batch_size, self.shuffle = x, y, batch_size, shuffle
        self.gen = torch.Generator().manual_seed(seed)
        self.batches_per_epoch = len(x) // batch_size
        self.epoch, self.index = 0, 0
        self.order = self._new_order()

    def _new_order(self):
        return torch.randperm(len(self.x), generator=self.gen) if self.shuffle else torch.arange(len(self.x))

    def next_batch(self):
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self.order = self._new_order()
        rows = self.order[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "epoch": self.epoch, "index": self.index, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.epoch, self.index, self.order = int(state["epoch"]), int(state["index"]), state["order"]


@dataclass
class Corpus:
    """A text corpus encoded as character ids, split into train and validation parts."""
    text_chars: int
    sha256: str
    chars: str              # the vocabulary, id i is chars[i]
    train: torch.Tensor     # (N_train,) int64
    val: torch.Tensor       # (N_val,) int64
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        lookup = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([lookup.get(c, lookup["?"]) for c in _clean(s)], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def _clean(text: str) -> str:
    """Keep printable ASCII and newlines; tabs become 4 spaces; anything else becomes '?'."""
    text = text.replace("\t", "    ")
    return "".join(c if (32 <= ord(c) < 127 or c == "\n") else "?" for c in text)


def read_stdlib(files=STDLIB_FILES) -> str:
    """Concatenate the given standard-library source files (sorted) from this interpreter's stdlib folder."""
    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in sorted(files):
        with open(os.path.join(root, name), encoding="utf-8") as fh:
            parts.append(f"# ---- {name} ----\n" + fh.read())
    return "\n".join(parts)


def char_corpus(text: str, *, val_every: int = 10, chunk: int = 4096, source: str = "text") -> Corpus:
    """Encode ``text`` by characters; every ``val_every``-th chunk of ``chunk`` characters is validation."""
    text = _clean(text)
    chars = "".join(sorted(set(text) | {"?"}))
    lookup = torch.full((128,), -1, dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
    ids = lookup[torch.tensor(list(text.encode("ascii")), dtype=torch.long)]  # (N,)
    pieces = ids.split(chunk)
    val = torch.cat([p for i, p in enumerate(pieces) if i % val_every == val_every - 1])
    train = torch.cat([p for i, p in enumerate(pieces) if i % val_every != val_every - 1])
    digest = hashlib.sha256(text.encode("ascii")).hexdigest()
    return Corpus(len(text), digest, chars, train, val, source)


def stdlib_corpus(files=STDLIB_FILES, **kwargs) -> Corpus:
    """The char corpus of the stdlib files ``files`` of the running Python. (Chapter 05.)"""
    version = ".".join(map(str, sys.version_info[:3]))
    return char_corpus(read_stdlib(files), source=f"Python {version} stdlib: {len(files)} files", **kwargs)


class CharBatches:
    """Random windows of ``block_size + 1`` characters: inputs ``(B, T)``, targets shifted by one ``(B, T)``."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int = 0):
        if len(data) <= block_size:
            raise ValueError(f"data has {len(data)} tokens, need more than block_size={block_size}")
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next_batch(self):
        starts = torch.randint(len(self.data) - self.block_size, (self.batch_size,), generator=self.gen)  # (B,)
        offsets = torch.arange(self.block_size + 1)                                                      # (T+1,)
        window = self.data[starts[:, None] + offsets]                                                    # (B, T+1)
        self.position += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.position = int(state["position"])


def fixed_windows(data: torch.Tensor, n: int, block_size: int, seed: int = 1234):
    """``n`` fixed windows for validation: ``(inputs (n, T), targets (n, T))``, the same on every call."""
    stream = CharBatches(data, n, block_size, seed=seed)
    return stream.next_batch()
