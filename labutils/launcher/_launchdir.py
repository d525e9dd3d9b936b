"""The launch directory (payload, store, results): who owns it, and sweeping those of dead callers. Internal.

Each launch makes one under the temporary directory, named ``TMP_PREFIX...``, with ``owner.json`` (the caller's
pid and start time). A caller killed by SIGKILL cannot remove its own: the next launch does
(:func:`sweep_stale_dirs`). (Chapter 00.)
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

TMP_PREFIX = "labutils-launch-"


def new_launch_dir() -> str:
    """A fresh launch directory recording its owner (this process), after sweeping those of dead owners."""
    sweep_stale_dirs()
    tmpdir = tempfile.mkdtemp(prefix=TMP_PREFIX)
    with open(os.path.join(tmpdir, "owner.json"), "w") as f:
        json.dump({"pid": os.getpid(), "start": _start_time(os.getpid()) or "?"}, f)
    return tmpdir


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        if not os.path.isdir("/proc"):  # no procfs: only whether the pid exists
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return "?"
        return None


def _owner_alive(owner: dict) -> bool:
    started = _start_time(owner["pid"])
    return started is not None and (started == owner["start"] or "?" in (started, owner["start"]))


def sweep_stale_dirs(tmp: str | None = None) -> list:
    """Remove the launch directories (payload, results, store) whose owner process has died: a caller killed
    by SIGKILL cannot clean up after itself. Only directories of this user that record an owner are
    touched. Returns the removed paths."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            if not name.startswith(TMP_PREFIX):
                continue
            try:
                if os.stat(path).st_uid != os.getuid():
                    continue
                with open(os.path.join(path, "owner.json")) as f:
                    alive = _owner_alive(json.load(f))
            except (OSError, ValueError, KeyError, TypeError):  # being written, or not ours to judge: keep
                continue
            if not alive:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed
