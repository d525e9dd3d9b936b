"""Execute notebooks in place (refresh the committed record) or into build/ (the book run).

    python tools/execute.py --inplace notebooks/01_fastmoe_core.ipynb
    python tools/execute.py --all --out build        # what `make book` runs

Per chapter it prints one line: name, seconds, PASS/FAIL. Exit status is non-zero if any chapter fails.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from nbhygiene import STRAY_CELL_KEYS  # noqa: E402


def execute(path: pathlib.Path, timeout: int) -> tuple:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as exc:
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    except Exception as exc:  # kernel died, timeout
        error = f"{type(exc).__name__}: {exc}"
    return tidy_record(nb), time.perf_counter() - t0, error


def tidy_record(nb):
    """Show this checkout's paths relative to it in the record (``labutils/...``, ``.venv/lib/...``): a reader's
    checkout lives elsewhere, and tools/nbhygiene.py rejects absolute paths in committed outputs. Per-user cell
    metadata that an editor may have left (``execution`` timings, ``collapsed``, ...) is dropped for the same reason."""
    root = f"{ROOT}/"
    for cell in nb.cells:
        for key in STRAY_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = out["text"].replace(root, "")
            if "traceback" in out:
                out["traceback"] = [line.replace(root, "") for line in out["traceback"]]
            for kind, value in out.get("data", {}).items():
                if kind.startswith("text/") and isinstance(value, str):
                    out["data"][kind] = value.replace(root, "")
    return nb


def to_html(nb, dest: pathlib.Path) -> None:
    from nbconvert import HTMLExporter
    body, _ = HTMLExporter().from_notebook_node(nb)
    dest.write_text(body, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path)
    ap.add_argument("--all", action="store_true", help="every notebooks/NN_*.ipynb in order")
    ap.add_argument("--inplace", action="store_true", help="write outputs back into the notebook")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build", help="where executed copies and HTML go")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    ap.add_argument("--times", type=pathlib.Path, default=None,
                    help="also write each chapter's wall seconds, with the date, preset and load, to this JSON "
                         "(docs/runtimes.json is what the README's runtime column is generated from)")
    args = ap.parse_args()
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) if args.all else args.notebooks
    if not paths:
        ap.error("no notebooks given")
    os.environ.pop("MPLBACKEND", None)  # kernels must use the inline backend so figures are recorded
    failed, total = [], time.perf_counter()
    preset = os.environ.get("LAB_PRESET") or "tiny"
    print(f"preset: {preset}", flush=True)
    times = {"preset": preset, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
             "load_avg_1min_start": os.getloadavg()[0], "seconds": {}}
    for path in paths:
        nb, seconds, error = execute(path, args.timeout)
        if args.inplace:
            nbformat.write(nb, path)
        else:
            (args.out / "executed").mkdir(parents=True, exist_ok=True)
            (args.out / "html").mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, args.out / "executed" / path.name)
            to_html(nb, args.out / "html" / path.with_suffix(".html").name)
        times["seconds"][path.stem] = round(seconds, 1)
        status = "PASS" if error is None else "FAIL"
        print(f"{path.stem:<28} {seconds:7.1f} s  {status}" + (f"  {error}" if error else ""), flush=True)
        if error:
            failed.append(path.stem)
    print(f"{'total':<28} {time.perf_counter() - total:7.1f} s  "
          f"{len(paths) - len(failed)} passed, {len(failed)} failed", flush=True)
    if args.times is not None and not failed:
        times["load_avg_1min_end"] = os.getloadavg()[0]
        args.times.write_text(json.dumps(times, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
