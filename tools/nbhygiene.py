"""Notebook hygiene: chapters are committed executed, top to bottom, without errors or stray metadata.

    python tools/nbhygiene.py [notebooks/NN_slug.ipynb ...]     # default: every chapter; exit 1 on a problem

Outputs are the lab book's record, so this KEEPS them (unlike nbstripout) and checks instead that:
every code cell ran, in order; no error output outside cells tagged ``raises-exception``; the kernel is the
lab's (``python3``); no widget state or per-user metadata (``collapsed``, ``scrolled``, ``ExecuteTime``) is
committed; no output shows an absolute path of the machine that executed it (home, /tmp, the checkout); and no
code cell is over ``MAX_CELL_LINES`` (40) lines (issue 39: a chapter reads like a book; a longer cell is a helper
in the package, or two cells with a sentence between them; ``tools/chapter_stats.py`` reports it too).
Used by the pre-commit hook and by ``make lint``.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRAY_CELL_KEYS = {"collapsed", "scrolled", "ExecuteTime", "execution"}
ABSOLUTE = re.compile(r"(/home/\w+|/root/|/tmp/|/work/|/Users/\w+|[A-Z]:\\\\Users)")
MAX_CELL_LINES = 40  # THE longest a code cell may be (issue 39), read by tools/chapter_stats.py


def cell_lines(source: str) -> int:
    """A code cell's length in lines, as the editor shows it (blank lines count, trailing ones do not)."""
    return len(source.rstrip().splitlines())


def output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    return "".join(data.get("text/plain", "")) + "".join(output.get("traceback", []))


def problems(path: pathlib.Path) -> list:
    nb = json.loads(path.read_text())
    found = []
    if nb.get("metadata", {}).get("kernelspec", {}).get("name") != "python3":
        found.append("kernelspec is not the lab's python3 kernel")
    if "widgets" in nb.get("metadata", {}):
        found.append("widget state in the notebook metadata")
    counts = []
    for i, cell in enumerate(nb["cells"]):
        where = f"cell {i}"
        stray = STRAY_CELL_KEYS & set(cell.get("metadata", {}))
        if stray:
            found.append(f"{where}: per-user metadata {sorted(stray)}")
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        lines = cell_lines("".join(cell["source"]))
        if lines > MAX_CELL_LINES:
            found.append(f"{where}: code cell of {lines} lines (over {MAX_CELL_LINES}: move code into the package "
                         f"or split the cell)")
        if cell.get("execution_count") is None:
            found.append(f"{where}: not executed")
        else:
            counts.append(cell["execution_count"])
        tags = cell.get("metadata", {}).get("tags", [])
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and "raises-exception" not in tags:
                found.append(f"{where}: error output ({out.get('ename')}) in a cell not tagged raises-exception")
            match = ABSOLUTE.search(output_text(out))
            if match:
                found.append(f"{where}: output shows an absolute path ({match.group(0)}...)")
    if counts != sorted(counts) or len(set(counts)) != len(counts):
        found.append("cells were executed out of order (re-run top to bottom)")
    return found


def main(argv: list) -> int:
    paths = [pathlib.Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bad = 0
    for path in paths:
        for problem in problems(path):
            print(f"{path}: {problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
