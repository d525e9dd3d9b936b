"""Which files of ``labutils/`` a student copies for each use, computed from the package's import graph.

    python tools/coursework_copies.py                 # print each copy's files and line count
    python tools/coursework_copies.py helper DEST     # write that copy to DEST/labutils/

Three copies, each a superset of the one before (the README's "`labutils` in your coursework" table is generated
from :func:`table`, ``tests/test_layout.py`` copies each alone and runs it):

* ``helper``: launch, workers, collectives, plots, parameter counts, data parallel, notebook tools: every module of
  the package's top folder and of the launch wing (``launcher/``) whose module-level imports stay inside that set;
* ``core``: + the MoE core (``moe/``: the layer, the fastmoe face, the modern wing) and what builds on it at module
  level (the MoE Transformer ``models``, the trainer ``train``);
* ``deepspeed``: + the DeepSpeed wing (``ds/``).

Chapter 08's timing catalogue is no part of ``labutils`` (it is the book's ``labbook/perf/``), so no copy holds it.
Imports inside functions do not count: a copy without ``ds/`` still imports ``models``, and asking it for a DeepSpeed
layer raises an ImportError that names what to copy or install.
"""
from __future__ import annotations

import ast
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "labutils"
COPIES = {
    "helper": "launch + plots: launch, workers, collectives, plots, parameter counts, data parallel, notebook tools",
    "core": "+ the MoE core: `moe/` (FMoE and the gates, the fastmoe face, chapter 09's wing), `models`, `train`",
    "deepspeed": "+ the DeepSpeed wing: `ds/`",
}
FOLDERS = {"helper": ("launcher",), "core": ("launcher", "moe"), "deepspeed": ("launcher", "moe", "ds")}


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts) or "__init__"


def module_level_imports(path: pathlib.Path) -> set:
    """The package modules ``path`` imports at module level (class bodies included, function bodies not)."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    package = "" if package == "__init__" else package
    found = set()

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.ImportFrom) and child.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                target = ".".join(base + ([child.module] if child.module else []))
                found.update(n for n in [target] + [f"{target}.{a.name}".strip(".") for a in child.names] if n)
            walk(child)

    walk(ast.parse(path.read_text()))
    return found


def files(copy: str) -> list:
    """The package files of ``copy`` (paths relative to the package folder), in a stable order."""
    if copy not in FOLDERS:
        raise ValueError(f"copy={copy!r}: expected one of {sorted(FOLDERS)}")
    every = {p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
    allowed = {p for p in every if len(p.relative_to(PKG).parts) == 1
               or p.relative_to(PKG).parts[0] in FOLDERS[copy]}
    names = {_module(p): p for p in every}
    changed = True
    while changed:  # drop every module that imports, at module level, a module outside the copy
        changed = False
        kept = {_module(p) for p in allowed}
        for p in sorted(allowed):
            outside = {m for m in module_level_imports(p) if m in names and m not in kept}
            if outside:
                allowed.discard(p)
                changed = True
    return sorted(str(p.relative_to(PKG)) for p in allowed)


def line_count(copy: str) -> int:
    return sum(len((PKG / f).read_text().splitlines()) for f in files(copy))


def make_copy(copy: str, dest: pathlib.Path, name: str = "labutils") -> pathlib.Path:
    """Write ``copy``'s files under ``dest/name/`` and return that folder."""
    out = pathlib.Path(dest) / name
    for f in files(copy):
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PKG / f, out / f)
    return out


def table() -> str:
    """The README's table: each copy, what it is for, its files' line count."""
    rows = ["| copy | what it holds | lines |", "|---|---|---|"]
    for copy, what in COPIES.items():
        rows.append(f"| `{copy}` | {what} | {line_count(copy):,} in {len(files(copy))} files |")
    return "\n".join(rows)


def main(argv) -> int:
    if len(argv) == 2:
        print("wrote", make_copy(argv[0], pathlib.Path(argv[1])))
        return 0
    for copy in COPIES:
        print(f"{copy}: {line_count(copy):,} lines, {len(files(copy))} files")
        print("   ", " ".join(files(copy)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
