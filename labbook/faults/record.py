"""The fingerprint a full fault run is tied to: every source it depends on. (Issue 38; see labbook.faults.)"""
from __future__ import annotations

import hashlib
import json

from labbook.faults.run import COPIED, ROOT

RECORD = ROOT / "docs" / "faults.json"


def _content(path) -> bytes:
    """A notebook counts by its code cells' sources (re-executing it changes only outputs); other files whole."""
    if path.suffix != ".ipynb":
        return path.read_bytes()
    cells = json.loads(path.read_text())["cells"]
    return "\0".join("".join(c["source"]) for c in cells if c["cell_type"] == "code").encode()


def code_fingerprint() -> str:
    """SHA-256 (16 hex digits) over the library, the book's machinery, the chapters' code, the benchmark records
    and the fault lists: a change to any of them makes a fault record stale."""
    h = hashlib.sha256()
    for name in COPIED:
        for path in sorted((ROOT / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and ".ipynb_checkpoints" not in path.parts \
                    and path.suffix in (".py", ".ipynb", ".json"):
                h.update(str(path.relative_to(ROOT)).encode() + b"\0" + _content(path) + b"\0")
    return h.hexdigest()[:16]


def record_status() -> str:
    """One sentence on docs/faults.json: how many faults it caught, and whether the code is still the one it ran."""
    if not RECORD.exists():
        return "no full fault run recorded yet (make faults writes docs/faults.json)"
    rec = json.loads(RECORD.read_text())
    fresh = "the code as it is now" if rec["code"] == code_fingerprint() else "code that has changed since"
    return (f"{rec['caught']} of {rec['faults']} injected faults caught by the checks they name "
            f"(make faults, {rec['date']}, {rec['seconds'] // 60} min at load {rec['load']:.1f}, on {fresh})")
