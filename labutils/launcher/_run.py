"""One launch, from the parent's side: the launch directory, the zygote process and its pipes, the events
they send, the wait for the ranks and the stop that leaves nothing behind. Internal; see ``launcher``
(chapter 00) and, for the other side of every channel, ``_worker``.
"""
from __future__ import annotations

import collections
import contextlib
import json
import mmap
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from ._failures import Reports
from ._launchdir import new_launch_dir
from ._procs import descendants
from ._watch import SLOT_BYTES

GRACE_S = 1.0  # after the first failure, how long to wait for the others' reports before killing them
STDERR_TAIL = 20  # last stderr lines kept per rank, shown when a rank is killed by a signal
STOP_GRACE_S = 5.0  # how long stop() lets the zygote kill what is below it before killing it itself


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def _package_root() -> str:
    """The folder to put on the ranks' path so that this package imports under its own name, whatever that
    is: ``labutils``, a renamed ``mylab``, or a nested ``vendor.labutils`` (then the folder above vendor/).
    A notebook that changed directory after importing it still finds it."""
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in (__package__ or __name__.rpartition(".")[0]).split("."):
        root = os.path.dirname(root)
    return root


# The zygote runs _worker.py by its path, not with ``-m labutils.launcher._worker``: a renamed (``mylab/``) or
# nested copy of the package, or one imported from a path not on sys.path, starts the same way, and run_path does
# not put the package's own folder on sys.path (its models.py must not shadow a user's ``models`` module).
_RUN_WORKER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"

class Run(Reports):
    """The state of one launch: processes, pipes, output and events (its reports: :class:`Reports`).
    ``threads``: torch threads per rank, already chosen (``backend.choose``)."""

    def __init__(self, world_size, backend, timeout, threads, env, debug=False):
        self.world_size, self.timeout, self.debug = world_size, timeout, debug
        self.tmpdir = new_launch_dir()
        self.stderr_tail: dict = collections.defaultdict(lambda: collections.deque(maxlen=STDERR_TAIL))
        self.events: queue.Queue = queue.Queue()
        self.pids, self.exits, self.errors = {}, {}, {}
        self.proc: subprocess.Popen | None = None
        self.calls: mmap.mmap | None = None
        self._watched: tuple | None = None  # (the ranks' calls, since when) while every live rank is in one
        self.threads = threads
        self.backend = backend
        self.env = env or {}

    # -- start -----------------------------------------------------------------------------------
    def start(self, payload: bytes) -> None:
        with open(os.path.join(self.tmpdir, "payload.pkl"), "wb") as f:
            f.write(payload)
        with open(os.path.join(self.tmpdir, "calls.bin"), "w+b") as f:  # the collective watch's slots
            f.truncate(SLOT_BYTES * self.world_size)
            self.calls = mmap.mmap(f.fileno(), SLOT_BYTES * self.world_size, access=mmap.ACCESS_READ)
        pipes = [os.pipe() for _ in range(2 * self.world_size)]
        out_pipes, err_pipes = pipes[: self.world_size], pipes[self.world_size:]
        cfg = {"world_size": self.world_size, "backend": self.backend, "tmpdir": self.tmpdir,
               "store_path": os.path.join(self.tmpdir, "store"), "threads": self.threads,
               "pg_timeout": self.timeout + 60, "parent_pid": os.getpid(),
               "out_fds": [w for _, w in out_pipes], "err_fds": [w for _, w in err_pipes]}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUN_WORKER, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py"),
             json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            pass_fds=cfg["out_fds"] + cfg["err_fds"], start_new_session=True, env=self._child_env())
        for _, w in pipes:
            os.close(w)
        for rank, (r, _) in enumerate(out_pipes):
            self._reader(os.fdopen(r, "rb"), ("out", rank))
        for rank, (r, _) in enumerate(err_pipes):
            self._reader(os.fdopen(r, "rb"), ("err", rank))
        self._reader(self.proc.stdout, ("event", None))
        self._reader(self.proc.stderr, ("zygote", None))

    def _child_env(self) -> dict:
        """The ranks' environment: the caller's, with the path that imports what the caller imports (this
        package's folder, then ``env``'s own PYTHONPATH entries, then the caller's ``sys.path``), the thread and
        interface settings, then ``env`` (whose PYTHONPATH is added to the path, never replaces it: the ranks must
        import the caller's modules to unpickle the function, and the caller the ranks' results)."""
        env = dict(os.environ)
        extra = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths = [_package_root()] + extra + [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        iface = _loopback_interface()
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface, PYTHONUNBUFFERED="1",
                   MPLBACKEND=env.get("MPLBACKEND", "agg"))
        env.pop("MASTER_PORT", None)
        if self.debug:  # torch checks every collective's op, shapes and dtypes against the other ranks first
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env.update({k: str(v) for k, v in self.env.items() if k != "PYTHONPATH"})
        return env

    def _reader(self, stream, tag) -> None:
        def pump():
            for raw in iter(stream.readline, b""):
                self.events.put((tag, raw.decode("utf-8", "replace").rstrip("\n"), time.time()))
            stream.close()

        threading.Thread(target=pump, daemon=True).start()

    # -- watch -----------------------------------------------------------------------------------
    def handle(self, tag, line, when) -> None:
        kind, rank = tag
        if kind == "out":
            print(f"[rank {rank}] {line}", flush=True)
        elif kind == "err":
            self.stderr_tail[rank].append(line)
            print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
        elif kind == "zygote":
            print(f"[launch] {line}", file=sys.stderr, flush=True)
        elif line.startswith("pid "):
            _, r, pid = line.split()
            self.pids[int(r)] = int(pid)
        elif line.startswith("exit "):
            _, r, code = line.split()
            self.exits[int(r)] = (int(code), when)

    def drain(self, wait: float) -> None:
        try:
            self.handle(*self.events.get(timeout=wait))
            while True:
                self.handle(*self.events.get_nowait())
        except queue.Empty:
            pass

    def failed_ranks(self) -> list:
        return [r for r, (code, _) in self.exits.items() if code != 0]

    def wait(self) -> list:
        deadline = time.monotonic() + self.timeout
        first_failure = None
        while True:
            self.drain(0.05)
            if len(self.exits) == self.world_size and not self.failed_ranks():
                return self.results()
            zygote_dead = self.proc is not None and self.proc.poll() is not None and len(self.exits) < self.world_size
            if (self.failed_ranks() or zygote_dead) and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and (time.monotonic() - first_failure > GRACE_S
                                              or len(self.exits) == self.world_size or zygote_dead):
                self.drain(0.2)
                raise self.failure_error()
            if time.monotonic() > deadline:
                raise self.timeout_error()
            if first_failure is None:
                mismatch = self.mismatch()
                if mismatch is not None:
                    raise mismatch

    # -- stop ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every process of the launch: the zygote kills what is below it (ranks, and whatever they started,
        in any session) on SIGTERM; what is left after ``STOP_GRACE_S`` is killed from here."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_GRACE_S)
            left = descendants(self.proc.pid) if self.proc.poll() is None else []
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and every rank share its session
            for pid in [*self.pids.values(), *left]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        if self.calls is not None:
            self.calls.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
