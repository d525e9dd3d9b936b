"""How much of each chapter is code, and how much of that code is prose in strings (issue 39: chapters that read
like a book).

    python tools/chapter_stats.py [notebooks/NN_slug.ipynb ...] [--json]    # default: every chapter (make stats)

Per chapter, over its code cells: the non-blank lines, the longest cell (in lines, as ``tools/nbhygiene.py`` counts
them), the cells over ``MAX_CELL_LINES`` (40), the share of the code's characters inside string literals (f-strings
included, read with ``tokenize``) and the lines inside ``Markdown(...)`` calls; then a total row. Prints a Markdown
table (or, with ``--json``, ``{"chapters": [...], "total": {...}, "targets": {...}, "misses": [...]}``) and checks
the issue's targets: no code cell over 40 lines, strings at most a third of every chapter's code, fewer than 4,000
code lines in all. Exit 1 when a target is missed, each miss named on stderr (the chapter, and the cell with its
length).
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import pathlib
import sys
import tokenize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from nbhygiene import MAX_CELL_LINES, ROOT, cell_lines  # noqa: E402  THE cell limit, one place

MAX_STRING_SHARE = 1 / 3     # of a chapter's code-cell characters, inside string literals
MAX_TOTAL_LINES = 4_000      # non-blank code lines over every chapter (the total must be below it)
STRING_TOKENS = {tokenize.STRING} | {getattr(tokenize, k) for k in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                                     if hasattr(tokenize, k)}  # Python 3.12 splits an f-string into parts


def string_chars(source: str) -> int:
    """Characters of ``source`` inside string literals (quotes and prefixes included; a whole f-string before 3.12).
    A cell ``tokenize`` cannot finish (an IPython magic, an unclosed bracket) counts what it read up to there."""
    found = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in STRING_TOKENS:
                found += len(tok.string)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return found


def markdown_lines(source: str) -> int:
    """Lines of ``source`` inside ``Markdown(...)`` calls (``Markdown`` or ``IPython.display.Markdown``), each line
    once. Lines of IPython magics (``%``, ``!``) are blanked first; a cell that still does not parse counts 0."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return 0
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Markdown":
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return len(lines)


def chapter_stats(path: pathlib.Path) -> dict:
    """One chapter's row: ``long_cells`` lists ``[cell index (as nbhygiene counts cells), lines, first line]``."""
    nb = json.loads(path.read_text())
    code_lines = chars = strings = md = longest = 0
    long_cells = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or not source.strip():
            continue
        length = cell_lines(source)
        code_lines += sum(1 for line in source.splitlines() if line.strip())
        longest = max(longest, length)
        if length > MAX_CELL_LINES:
            first = next(line for line in source.splitlines() if line.strip()).strip()
            long_cells.append([i, length, first[:60].rstrip()])
        chars += len(source)
        strings += string_chars(source)
        md += markdown_lines(source)
    return {"chapter": path.stem, "code_lines": code_lines, "longest_cell": longest, "long_cells": long_cells,
            "chars": chars, "string_chars": strings, "string_share": strings / chars if chars else 0.0,
            "markdown_lines": md}


def total_row(rows: list) -> dict:
    chars, strings = sum(r["chars"] for r in rows), sum(r["string_chars"] for r in rows)
    return {"chapter": "total", "code_lines": sum(r["code_lines"] for r in rows),
            "longest_cell": max((r["longest_cell"] for r in rows), default=0),
            "long_cells": [[r["chapter"], *c] for r in rows for c in r["long_cells"]],
            "chars": chars, "string_chars": strings, "string_share": strings / chars if chars else 0.0,
            "markdown_lines": sum(r["markdown_lines"] for r in rows)}


def misses(rows: list, total: dict) -> list:
    """Each missed target in words, naming the chapter (and the cell and its length)."""
    found = []
    for r in rows:
        for i, length, first in r["long_cells"]:
            found.append(f"{r['chapter']}: cell {i} has {length} lines (over {MAX_CELL_LINES}): {first}")
        if r["string_share"] > MAX_STRING_SHARE:
            found.append(f"{r['chapter']}: {r['string_share']:.0%} of the code's characters are in strings "
                         f"(over a third)")
    if total["code_lines"] >= MAX_TOTAL_LINES:
        found.append(f"total: {total['code_lines']:,} code lines (the target is under {MAX_TOTAL_LINES:,})")
    return found


def table(rows: list, total: dict) -> str:
    head = (f"| chapter | code lines | longest cell | cells over {MAX_CELL_LINES} lines | strings "
            f"| lines in `Markdown(` |\n|---|---:|---:|---:|---:|---:|")
    body = [f"| {r['chapter']} | {r['code_lines']:,} | {r['longest_cell']} | {len(r['long_cells'])} "
            f"| {r['string_share']:.0%} | {r['markdown_lines']} |" for r in rows]
    t = total
    body.append(f"| **total** | **{t['code_lines']:,}** | **{t['longest_cell']}** | **{len(t['long_cells'])}** "
                f"| **{t['string_share']:.0%}** | **{t['markdown_lines']}** |")
    return "\n".join([head, *body])


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every chapter")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    rows = [chapter_stats(p) for p in paths]
    total = total_row(rows)
    missed = misses(rows, total)
    if args.json:
        targets = {"max_cell_lines": MAX_CELL_LINES, "max_string_share": MAX_STRING_SHARE,
                   "max_total_lines": MAX_TOTAL_LINES}
        print(json.dumps({"chapters": rows, "total": total, "targets": targets, "misses": missed}, indent=1))
    else:
        print(table(rows, total))
    for miss in missed:
        print(f"target missed: {miss}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
