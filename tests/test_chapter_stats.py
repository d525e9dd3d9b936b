"""tools/chapter_stats.py (issue 39's table, regenerated from the notebooks) and nbhygiene's 40-line rule, on small
synthetic notebooks: a chapter that meets every target passes; one that misses them fails naming each miss, and for
that reason only."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import chapter_stats  # noqa: E402
import nbhygiene  # noqa: E402


def _notebook(path: pathlib.Path, *cells) -> pathlib.Path:
    """A minimal executed chapter: each cell a code string (or ("markdown", text))."""
    nb_cells = []
    for n, cell in enumerate(cells, 1):
        if isinstance(cell, tuple):
            nb_cells.append({"cell_type": "markdown", "metadata": {}, "source": cell[1]})
        else:
            nb_cells.append({"cell_type": "code", "execution_count": n, "metadata": {}, "outputs": [],
                             "source": cell.splitlines(keepends=True)})
    nb = {"cells": nb_cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


GOOD = [("markdown", "# A chapter\nProse lives here."),
        "import torch\n\nx = torch.ones(3)\ny = x * 2\n",
        "\n".join(f"v{i} = {i} * 2" for i in range(40)),           # exactly 40 lines: allowed
        'from IPython.display import Markdown, display\n%time z = 1\ndisplay(Markdown(f"y is {y}"))\n']

LONG = "\n".join(f"w{i} = {i} + 1" for i in range(41))              # 41 lines
WORDY = ('msg = ("a long sentence that belongs in a markdown cell, not in code, "\n'
         '       f"and more of it, {1 + 1} times over, and then some more words")\nprint(msg)\n')


def test_a_chapter_that_meets_every_target_passes(tmp_path, capsys):
    path = _notebook(tmp_path / "01_good.ipynb", *GOOD)
    row = chapter_stats.chapter_stats(path)
    assert row["code_lines"] == 3 + 40 + 3 and row["longest_cell"] == 40 and row["long_cells"] == []
    assert row["markdown_lines"] == 1 and 0 < row["string_share"] < 1 / 3
    assert chapter_stats.main([str(path)]) == 0
    out = capsys.readouterr()
    assert "| 01_good | 46 | 40 | 0 |" in out.out and "| **total** | **46** |" in out.out and out.err == ""
    assert nbhygiene.problems(path) == []


def test_a_chapter_that_misses_fails_naming_each_miss(tmp_path, capsys):
    """A long cell (its strings are few) fails for its length alone; a wordy chapter (its cells are short) for its
    strings alone; the chapter that meets every target is in neither line."""
    good = _notebook(tmp_path / "01_good.ipynb", *GOOD)
    long = _notebook(tmp_path / "02_long.ipynb", "import torch\n", LONG)
    wordy = _notebook(tmp_path / "03_wordy.ipynb", "import torch\n", WORDY)
    assert chapter_stats.main([str(good), str(long), str(wordy), "--json"]) == 1
    out = capsys.readouterr()
    report = json.loads(out.out)
    rows = {r["chapter"]: r for r in report["chapters"]}
    assert list(rows) == ["01_good", "02_long", "03_wordy"]
    assert rows["02_long"]["string_share"] == 0 and rows["03_wordy"]["string_share"] > 1 / 3
    assert report["misses"] == [
        "02_long: cell 1 has 41 lines (over 40): w0 = 0 + 1",
        f"03_wordy: {rows['03_wordy']['string_share']:.0%} of the code's characters are in strings (over a third)"]
    assert report["total"]["code_lines"] == 46 + 1 + 41 + 1 + 3 and report["total"]["long_cells"] == [
        ["02_long", 1, 41, "w0 = 0 + 1"]]
    assert out.err.splitlines() == [f"target missed: {m}" for m in report["misses"]]
    assert nbhygiene.problems(long) == ["cell 1: code cell of 41 lines (over 40: move code into the package or "
                                        "split the cell)"]
    assert nbhygiene.problems(wordy) == []


def test_the_total_line_target(tmp_path, monkeypatch):
    path = _notebook(tmp_path / "03_short.ipynb", "a = 1\nb = 2\n")
    monkeypatch.setattr(chapter_stats, "MAX_TOTAL_LINES", 2)
    rows = [chapter_stats.chapter_stats(path)]
    assert chapter_stats.misses(rows, chapter_stats.total_row(rows)) == [
        "total: 2 code lines (the target is under 2)"]


def test_strings_are_counted_by_tokens_and_markdown_calls_by_lines():
    assert chapter_stats.string_chars('x = "ab" + f"c{d}"\n# "not a string"\n') == len('"ab"') + len('f"c{d}"')
    assert chapter_stats.string_chars("%timeit f(\n") == 0  # unfinished: what was read
    src = 'display(Markdown(\n    "a"\n    "b"))\nprint(1)\nIPython.display.Markdown("c")\n'
    assert chapter_stats.markdown_lines(src) == 4
    assert chapter_stats.markdown_lines("def (:\n") == 0


def test_the_command_line_exits_1_on_a_miss(tmp_path):
    bad = _notebook(tmp_path / "02_bad.ipynb", LONG)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "chapter_stats.py"), str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "02_bad: cell 0 has 41 lines" in proc.stderr, proc.stdout + proc.stderr
