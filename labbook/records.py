"""Benchmark records: where they live, and whether the code that made them has changed since. (Issue 38.)

Every record written by :func:`labbook.perf.timing.save_result` carries ``"code"``: the SHA-256 (first 16 hex
digits) of the source of every module of ``labutils`` and ``labbook`` loaded when it was written, by path. A
chapter that shows a record says, from :func:`code_status`, whether those files still read the same. Records
are found relative to the repository (:data:`RESULTS`), never the working directory.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGES = ("labutils", "labbook")


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def fingerprint(modules=None) -> dict:
    """{path relative to the repository: digest} of ``modules`` (names; default: every loaded module of the
    lab's packages)."""
    names = modules if modules is not None else [m for m in list(sys.modules)
                                                 if m.split(".")[0] in PACKAGES]
    out = {}
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file is None and modules is None:
            continue  # a name without a file of its own (a forwarding alias, a namespace)
        if file is None:
            raise ValueError(f"module {name!r} is not loaded or has no source file; pass loaded module names")
        path = pathlib.Path(file).resolve()
        if path.is_relative_to(ROOT):
            out[str(path.relative_to(ROOT))] = _digest(path)
    return dict(sorted(out.items()))


def path(name: str) -> pathlib.Path:
    """The record ``name`` under benchmarks/results/ (``name`` is a file name such as ``token_exchange.json``)."""
    if "/" in name or "\\" in name:
        raise ValueError(f"name must be a file name under benchmarks/results/, got {name!r}")
    return RESULTS / name


def load(name: str) -> dict:
    """The record ``name`` as a dict; FileNotFoundError names the file and the folder searched."""
    p = path(name)
    if not p.exists():
        raise FileNotFoundError(f"no record {name!r} in {RESULTS} (the repository's benchmarks/results/)")
    return json.loads(p.read_text())


def load_optional(name: str) -> dict | None:
    """The record ``name`` as a dict, or None when it has not been recorded (no such file under
    benchmarks/results/): for records only some machines can make, such as ``gpu_layer.json`` (a CUDA GPU), which
    a chapter shows when present and says plainly it lacks when not."""
    p = path(name)
    return json.loads(p.read_text()) if p.exists() else None


def changed(record: dict) -> list | None:
    """Files of the record's fingerprint whose source differs now (or is gone); None without a fingerprint."""
    code = record.get("code")
    if not isinstance(code, dict):
        return None
    return [p for p, digest in code.items() if not (ROOT / p).exists() or _digest(ROOT / p) != digest]


def code_status(record: dict, name: str = "this record") -> str:
    """One sentence for a chapter: is the code that made ``record`` the code here?"""
    files = changed(record)
    if files is None:
        return (f"{name} carries no code fingerprint (written before records carried one), so it is not tied to "
                "today's code: its numbers may predate changes since")
    if not files:
        return f"{name} was made by the code as it is now ({len(record['code'])} source files fingerprinted)"
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"the code has changed since {name} was made ({shown}): re-run its benchmark to refresh it"
