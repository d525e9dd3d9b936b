"""Round-trip notebooks and percent-format scripts, so chapters can be edited as plain text.

    python tools/nbpy.py to-py notebooks/01_fastmoe_core.ipynb  > /tmp/01.py   # edit it
    python tools/nbpy.py to-nb /tmp/01.py notebooks/01_fastmoe_core.ipynb      # outputs are dropped

Cells: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell (lines prefixed with ``# ``),
and ``tags=["a", "b"]`` after either sets cell tags. The notebook stays the single source of truth.
"""
from __future__ import annotations

import json
import re
import sys

import nbformat

HEADER = re.compile(r'^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$')


def to_py(nb) -> str:
    parts = []
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        t = f" tags={json.dumps(tags)}" if tags else ""
        if cell.cell_type == "markdown":
            body = "\n".join(("# " + line) if line else "#" for line in cell.source.splitlines())
            parts.append(f"# %% [markdown]{t}\n{body}")
        else:
            parts.append(f"# %%{t}\n{cell.source}")
    return "\n\n".join(parts) + "\n"


def to_nb(text: str):
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        while lines and not lines[-1].strip():
            lines.pop()
        if kind == "markdown":
            src = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines)
            cell = nbformat.v4.new_markdown_cell(src)
        else:
            cell = nbformat.v4.new_code_cell("\n".join(lines))
        if tags:
            cell.metadata["tags"] = tags
        cells.append(cell)

    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            tags = json.loads(m.group("tags")) if m.group("tags") else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main(argv):
    if len(argv) < 2 or argv[0] not in {"to-py", "to-nb"}:
        sys.exit(__doc__)
    if argv[0] == "to-py":
        sys.stdout.write(to_py(nbformat.read(argv[1], as_version=4)))
    else:
        with open(argv[1]) as f:
            nb = to_nb(f.read())
        nbformat.validator.normalize(nb)
        nbformat.write(nb, argv[2])


if __name__ == "__main__":
    main(sys.argv[1:])
