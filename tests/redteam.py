"""Shared by the grader's red-team tests (tests/test_grader_chNN.py): grade source text through the grading service
(a fresh process, as a student's check() and the instructor's command do) and assert the verdict and the rule."""
from __future__ import annotations

import functools
import inspect
import json
import pathlib
import re
import subprocess
import sys
import textwrap

from labbook.grader import service

ROOT = pathlib.Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def solution(name: str) -> str:
    """The book's own solution cell for exercise ``name`` (the honest answer), read from its chapter."""
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            if "solution" in cell.get("metadata", {}).get("tags", []) and re.search(rf"^def {name}\(", src, re.M):
                return src
    raise LookupError(name)


def passes(name: str, src: str, **kw):
    """``src`` passes exercise ``name``; returns the report."""
    report = service.grade(name, textwrap.dedent(src), **kw)
    assert report.passed, f"an honest solution of {name} failed:\n{report.text()}"
    return report


def fails(name: str, src: str, rule: str | None = None, says: str | None = None, **kw):
    """``src`` fails exercise ``name``; with ``rule``, the report names that rule (``rule 'import'``); with
    ``says``, its text contains that phrase. Returns the report."""
    report = service.grade(name, textwrap.dedent(src), **kw)
    assert not report.passed, f"a cheat passed {name}:\n{src}\n{report.text()}"
    if rule is not None:
        assert f"rule '{rule}'" in report.text(), f"expected rule '{rule}' for {name}:\n{report.text()}"
    if says is not None:
        assert says in report.text(), f"expected {says!r} for {name}:\n{report.text()}"
    return report


def pasted(fn, name: str, call: str) -> str:
    """A cheat's source: the library function ``fn``'s source pasted verbatim (under its own name), and the
    exercise's function ``name`` returning ``call``. The grader must refuse it by identity or by another rule."""
    src = textwrap.dedent(inspect.getsource(fn))
    src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("@"))
    return f"import torch\n\n{src}\n\ndef {name}(*args):\n    return {call}\n"


@functools.lru_cache(maxsize=1)
def renamed_copy(tmp_root: str) -> pathlib.Path:
    """A renamed coursework copy of labutils (``mylab``), made by tools/coursework_copies.py under ``tmp_root``."""
    dest = pathlib.Path(tmp_root) / "mylab"
    if not dest.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "coursework_copies.py"), "core", str(dest)], check=True,
                       capture_output=True, timeout=300)
    return dest


def wrong(name: str, src: str):
    """``src`` runs and answers every case, and some answers are wrong: no rule broken, nothing raised."""
    report = fails(name, src)
    assert "rule '" not in report.text() and "raised" not in report.text(), report.text()
    return report


def only_hidden_wrong(report) -> int:
    """Every visible case matched and some hidden ones did not (the shortcut fits the printed cases); returns how
    many hidden cases matched."""
    good, n = map(int, re.search(r"(\d+) of (\d+) hidden cases match", report.text()).groups())
    failed = re.search(r"\(([^)]*)\); hidden seed", report.reason).group(1).replace(" ...", "").split(", ")
    assert n - good > 0 and all(label.startswith("hidden") for label in failed), report.text()
    return good


def with_body(name: str, head: str, body: str) -> str:
    """``head`` (top-level lines), the book's solution renamed ``honest``, and ``name`` running ``body`` (``r =
    honest(*args)`` is the right answer)."""
    honest = re.sub(rf"^def {name}\(", "def honest(", solution(name), flags=re.M)
    return f"{head}\n{honest}\n\ndef {name}(*args):\n    r = honest(*args)\n{body}\n"
