"""Processes of a launch: die with the parent, list and kill every process below one. Internal (chapter 00).

Shared by the parent (``launcher``: what is left below a zygote) and the zygote (``_worker``: its ranks and
whatever they started). Imports nothing of its package: the zygote loads this file by its path.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL, on_death=None) -> None:
    """Ask Linux to send ``sig`` when our parent dies; fall back to polling getppid elsewhere (then
    ``on_death()`` runs, or we exit)."""
    armed = prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        if on_death is not None:
            on_death()
        os._exit(1)
    if armed:
        return

    def watch():
        while True:
            if os.getppid() != expected_parent:
                if on_death is not None:
                    on_death()
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def descendants(root: int) -> list:
    """Live (non-zombie) processes below ``root``, from /proc (parents before children); [] without procfs."""
    children: dict = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def kill_tree(root: int, rounds: int = 50) -> int:
    """SIGKILL every process below ``root`` (a process forking meanwhile is caught in the next round; as a
    subreaper ``root`` inherits the orphans). Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        procs = descendants(root)
        if not procs:
            break
        for pid in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        if root == os.getpid():
            reap()
        time.sleep(0.01)
    return killed


def reap(wait_s: float = 0.0) -> None:
    """Collect every child that has exited (the zygote's orphans too); with ``wait_s``, wait up to that long for
    the killed ones to finish dying (a zombie left behind is handed to init, which may be slow to reap it)."""
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(ChildProcessError):
        while True:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)


def status_code(status: int) -> int:
    """waitpid status -> exit code, or -signal number when killed by a signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
