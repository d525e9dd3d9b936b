"""Every check in a chapter, shown to catch the fault it names (issue 38). The book's machinery, not coursework.

A :class:`Fault` is a realistic bug a reader might make, written as exact text edits: to a chapter's cells
(``edits``: a cell id, the text, its replacement) and/or to a copy of the library (``library``: a path under the
repository). :mod:`labbook.faults.run` applies them to a copy of the repository and executes the chapter up to
the cell named by ``check``; the fault is *caught* when that cell is the first to fail and its error says
``expect``. An edit whose text is not found exactly once is an error: a fault list can't go stale silently.

The lists live in ``labbook/faults/chNN.py`` (``FAULTS``); ``python -m labbook.faults [NN ...]`` runs them and
``tests/test_chapter_faults.py`` asserts every one is caught and that the unedited chapter passes the same cells.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` (exactly one occurrence) in a chapter cell (by id) or a library file (by path)."""

    where: str
    old: str
    new: str


@dataclass(frozen=True)
class Fault:
    """One injected bug and the check cell that must catch it.

    ``cells``: the code cells to execute, by id, in chapter order (default: every code cell up to ``check``).
    A subset keeps a fault's run short; the harness then also runs the same subset unedited, which must pass.
    """

    name: str
    check: str
    expect: str
    edits: tuple = field(default=())
    library: tuple = field(default=())
    cells: tuple = field(default=())

    def __post_init__(self):
        if not self.edits and not self.library:
            raise ValueError(f"fault {self.name!r}: give at least one edit (edits= or library=)")
        for e in (*self.edits, *self.library):
            if not isinstance(e, Edit):
                raise TypeError(f"fault {self.name!r}: edits must be Edit(where, old, new), got {e!r}")
            if e.old == e.new:
                raise ValueError(f"fault {self.name!r}: the edit in {e.where!r} changes nothing")
        if self.cells and self.check not in self.cells:
            raise ValueError(f"fault {self.name!r}: its check cell {self.check!r} is not among cells={self.cells}")


CHAPTERS = tuple(f"{n:02d}" for n in range(10))


def faults(chapter: str) -> list:
    """The fault list of chapter ``chapter`` ('00'..'09')."""
    if chapter not in CHAPTERS:
        raise ValueError(f"chapter must be one of {', '.join(CHAPTERS)}; got {chapter!r}")
    try:
        mod = importlib.import_module(f"labbook.faults.ch{chapter}")
    except ModuleNotFoundError:
        return []
    return list(mod.FAULTS)
