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
import numbers
import os
import pathlib
import sys
import sysconfig
from dataclasses import dataclass

import torch

# A fixed, sorted list of pure-Python stdlib modules (about 1.1 MB on Python 3.11).
STDLIB_FILES = ("argparse.py", "ast.py", "calendar.py", "configparser.py", "copy.py", "csv.py", "dataclasses.py",
                "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "inspect.py", "pathlib.py",
                "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py", "textwrap.py", "threading.py",
                "typing.py")


def _size(name: str, value, minimum: int = 1) -> int:
    """An int >= ``minimum`` (bools and floats refused), or a ValueError naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_state(stream, state, keys: tuple) -> None:
    """A stream state with the keys ``keys``, or an error naming what is missing (another stream's state?)."""
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{type(stream).__name__}.load_state_dict: the state lacks {missing} "
                         f"(a state of another kind of stream?); it has {got}")


class _SeededStream:
    """A stream drawing from its own seeded ``torch.Generator``: its state is the generator and the batch count."""

    gen: torch.Generator
    position: int

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, ("gen", "position"))
        self.gen.set_state(state["gen"])
        self.position = int(state["position"])


class RandomPairs(_SeededStream):
    """An endless stream of independent N(0, 1) ``(x, y)`` of shape ``(batch, T, d)``: the book's random data."""

    def __init__(self, batch: int, T: int, d: int, seed: int = 0):
        self.shape = (_size("batch", batch), _size("T", T), _size("d", d))
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next_batch(self):
        x = torch.randn(self.shape, generator=self.gen)  # (B, T, d)
        y = torch.randn(self.shape, generator=self.gen)  # (B, T, d)
        self.position += 1
        return x, y


class EpochBatches:
    """A fixed dataset ``(x, y)`` cut into minibatches, reshuffled every epoch (``drop_last``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
        if x.ndim == 0 or y.ndim == 0:
            raise ValueError(f"x and y need a sample dimension first, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
        if len(x) != len(y):
            raise ValueError(f"x and y have different lengths {len(x)} and {len(y)}")
        if _size("batch_size", batch_size) > len(x):
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
        _check_state(self, state, ("gen", "epoch", "index", "order"))
        if len(state["order"]) != len(self.x) or not 0 <= int(state["index"]) <= self.batches_per_epoch:
            raise ValueError(f"EpochBatches.load_state_dict: the state is of a dataset of {len(state['order'])} "
                             f"samples at batch {int(state['index'])}, this one has {len(self.x)} samples in "
                             f"{self.batches_per_epoch} batches of {self.batch_size}")
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
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _size("val_every", val_every, minimum=2)
    _size("chunk", chunk)
    text = _clean(text)
    if -(-len(text) // chunk) < val_every:  # fewer chunks than val_every: no validation chunk
        raise ValueError(f"text has {len(text)} characters: with chunk={chunk} and val_every={val_every} the "
                         f"validation split needs more than {chunk * (val_every - 1)}; lower chunk or val_every")
    chars = "".join(sorted(set(text) | {"?"}))
    lookup = torch.full((128,), -1, dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
    ids = lookup[torch.tensor(list(text.encode("ascii")), dtype=torch.long)]  # (N,)
    pieces = ids.split(chunk)
    val = torch.cat([p for i, p in enumerate(pieces) if i % val_every == val_every - 1])
    train = torch.cat([p for i, p in enumerate(pieces) if i % val_every != val_every - 1])
    digest = hashlib.sha256(text.encode("ascii")).hexdigest()
    return Corpus(len(text), digest, chars, train, val, source)


# Folders of the stdlib that are not ordinary source: tests, codec tables, generated documentation strings.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"})
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 characters: newline and printable ASCII


def stdlib_sources(root: str | None = None) -> list:
    """Every pure-Python source file of the stdlib outside ``SKIP_DIRS``, as sorted relative paths."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(str(p.relative_to(base)) for p in base.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(base).parts[:-1]))


def is_validation_file(relpath: str, one_in: int) -> bool:
    """A file is held out when the SHA-256 of its path is 0 modulo ``one_in``: stable across machines."""
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % one_in == 0


def stdlib_file_corpus(one_in: int = 25, root: str | None = None) -> Corpus:
    """The whole pure-Python stdlib, split **by file**: about one file in ``one_in`` is validation, so no
    validation text sits inside a training file. Vocabulary: the fixed 96 characters of ``VOCAB``. (Chapter 05.)"""
    _size("one_in", one_in, minimum=2)
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(str(base))
    parts: dict = {True: [], False: []}
    for rel in files:
        parts[is_validation_file(rel, one_in)].append(f"# ---- {rel} ----\n" + (base / rel).read_text("utf-8"))
    if not parts[True] or not parts[False]:
        raise ValueError(f"{len(files)} files under {base}: one_in={one_in} leaves an empty split")
    lookup = torch.full((128,), VOCAB.index("?"), dtype=torch.long)
    lookup[torch.tensor([ord(c) for c in VOCAB])] = torch.arange(len(VOCAB))

    def encode(texts):
        text = _clean("\n".join(texts))
        return text, lookup[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]

    train_text, train = encode(parts[False])
    val_text, val = encode(parts[True])
    digest = hashlib.sha256((train_text + "\0" + val_text).encode("ascii")).hexdigest()
    version = ".".join(map(str, sys.version_info[:3]))
    source = (f"Python {version} stdlib: {len(parts[False])} training files, {len(parts[True])} validation files "
              f"(split by file)")
    return Corpus(len(train_text) + len(val_text), digest, VOCAB, train, val, source)


def stdlib_corpus(files=STDLIB_FILES, **kwargs) -> Corpus:
    """The char corpus of the stdlib files ``files`` of the running Python. (Chapter 05.)"""
    version = ".".join(map(str, sys.version_info[:3]))
    return char_corpus(read_stdlib(files), source=f"Python {version} stdlib: {len(files)} files", **kwargs)


class CharBatches(_SeededStream):
    """Random windows of ``block_size + 1`` characters: inputs ``(B, T)``, targets shifted by one ``(B, T)``."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int = 0):
        if not isinstance(data, torch.Tensor) or data.ndim != 1 or data.is_floating_point() or data.is_complex():
            raise ValueError("data must be a 1-D tensor of token ids (e.g. corpus.train), got "
                             + (f"{data.dtype} of shape {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                                else type(data).__name__))
        _size("batch_size", batch_size)
        if len(data) <= _size("block_size", block_size):
            raise ValueError(f"data has {len(data)} tokens, need at least block_size + 1 = {block_size + 1} "
                             "(a window and its shifted target)")
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next_batch(self):
        starts = torch.randint(len(self.data) - self.block_size, (self.batch_size,), generator=self.gen)  # (B,)
        offsets = torch.arange(self.block_size + 1)                                                      # (T+1,)
        window = self.data[starts[:, None] + offsets]                                                    # (B, T+1)
        self.position += 1
        return window[:, :-1], window[:, 1:]


def fixed_windows(data: torch.Tensor, n: int, block_size: int, seed: int = 1234):
    """``n`` fixed windows for validation: ``(inputs (n, T), targets (n, T))``, the same on every call."""
    _size("n", n)
    stream = CharBatches(data, n, block_size, seed=seed)
    return stream.next_batch()
