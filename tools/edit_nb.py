"""Replace one cell's source, keeping its id, tags and outputs (re-execute the chapter afterwards).

    python tools/edit_nb.py notebooks/01_fastmoe_core.ipynb CELL_ID < new_source.py
"""
import sys

import nbformat


def main() -> int:
    path, cid = sys.argv[1], sys.argv[2]
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.get("id") == cid:
            cell.source = sys.stdin.read().rstrip("\n")
            nbformat.write(nb, path)
            return 0
    sys.stderr.write(f"{path}: no cell with id {cid!r}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
