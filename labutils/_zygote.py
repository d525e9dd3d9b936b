"""The process that forks the ranks of one `launch` call. Internal; see labutils/launch.py.

It starts as a fresh interpreter, imports torch once, and forks one child per rank *before* any tensor
op has run in it (so fork is safe: no OpenMP pool, no CUDA context). Each child unpickles the user's
function by value, joins the process group through a FileStore and writes its result or traceback to
the launch's temporary directory. The zygote reports `pid RANK PID` and `exit RANK STATUS` lines on
stdout and dies with its parent.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask Linux to SIGKILL us when our parent dies; fall back to polling getppid elsewhere."""
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)
    if armed:
        return

    def watch():
        while True:
            if os.getppid() != expected_parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def status_code(status: int) -> int:
    """waitpid status -> exit code, or -signal number when killed by a signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent(cfg["parent_pid"])
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401  (imported once, shared by every forked rank)
    import torch.distributed  # noqa: F401

    from labutils import _rank

    pids = {}
    for rank in range(cfg["world_size"]):
        pid = os.fork()
        if pid == 0:
            _rank.run(rank, cfg)  # never returns
        pids[pid] = rank
        print(f"pid {rank} {pid}", flush=True)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    while pids:
        pid, status = os.waitpid(-1, 0)
        print(f"exit {pids.pop(pid)} {status_code(status)}", flush=True)


if __name__ == "__main__":
    main()
