"""Run a function on local distributed workers from a notebook cell. (Taught in chapter 00.)

    from labutils import launch

    def hello(scale):
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0]) * scale
        dist.all_reduce(t)
        return t.item()

    launch(hello, 4, 10.0)   # -> [100.0, 100.0, 100.0, 100.0]

How it works (and why): `torch.multiprocessing.spawn` cannot unpickle a function defined in a notebook,
`fork` of the kernel deadlocks once it has run a matmul and cannot carry CUDA, and `torchrun` is slow and
orphans workers when killed. So `launch` ships the function *by value* (cloudpickle) to a fresh
interpreter (labutils/_zygote.py) that imports torch once and forks one process per rank before any tensor
op runs. Ranks meet through a FileStore in a temporary directory: no port is chosen by us, so no race, and
gloo is bound to the loopback interface. Each rank's output appears in the cell prefixed with its rank.
A rank that raises or dies stops the whole launch within about a second with a `WorkerError`; a rank
stuck at the timeout is reported with its Python stack. Nothing outlives the call: the ranks die with the
zygote, which dies with the caller.

The same function runs unchanged under torchrun through ``python -m labutils.entry`` (see that module).
"""
from __future__ import annotations

import json
import linecache
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle

__all__ = ["launch", "WorkerError", "worker_info", "default_backend"]

GRACE_S = 1.0  # after the first failure, how long to wait for the others' reports before killing them
COMM_ERRORS = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket Timeout",
               "Gloo connectFullMesh failed", "NCCL communicator was aborted")


class WorkerError(RuntimeError):
    """A rank raised, died or got stuck. ``rank`` is the first failing rank (None at a timeout).

    ``exitcode`` is the rank's exit code (negative: killed by that signal), ``remote_traceback`` its
    traceback and ``stacks`` the Python stacks of the ranks that were stuck at a timeout.
    """

    def __init__(self, message, rank=None, exitcode=None, remote_traceback="", stacks=None):
        super().__init__(message)
        self.rank, self.exitcode, self.remote_traceback = rank, exitcode, remote_traceback
        self.stacks = stacks or {}


def default_backend(world_size: int) -> str:
    """NCCL when CUDA has at least ``world_size`` GPUs, else gloo."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def worker_info() -> dict:
    """Rank, world size, backend and device of the calling worker (for use inside ``fn``)."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": backend, "device": device}


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def _cell_sources() -> dict:
    """Notebook cells live only in linecache (ipykernel files, <ipython-input-...>): ship them along."""
    return {name: entry[2] for name, entry in list(linecache.cache.items())
            if len(entry) >= 3 and ("ipykernel_" in name or name.startswith("<ipython-input"))}


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Run:
    """The state of one launch: processes, pipes, output and events."""

    def __init__(self, world_size, backend, timeout, threads, env):
        self.world_size, self.timeout = world_size, timeout
        self.tmpdir = tempfile.mkdtemp(prefix="labutils-launch-")
        self.events: queue.Queue = queue.Queue()
        self.pids, self.exits, self.errors = {}, {}, {}
        self.proc = None
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) // world_size)
        self.backend = backend
        self.env = env or {}

    # -- start -----------------------------------------------------------------------------------
    def start(self, payload: bytes) -> None:
        with open(os.path.join(self.tmpdir, "payload.pkl"), "wb") as f:
            f.write(payload)
        pipes = [os.pipe() for _ in range(2 * self.world_size)]
        out_pipes, err_pipes = pipes[: self.world_size], pipes[self.world_size:]
        cfg = {"world_size": self.world_size, "backend": self.backend, "tmpdir": self.tmpdir,
               "store_path": os.path.join(self.tmpdir, "store"), "threads": self.threads,
               "pg_timeout": self.timeout + 60, "parent_pid": os.getpid(),
               "out_fds": [w for _, w in out_pipes], "err_fds": [w for _, w in err_pipes]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labutils._zygote", json.dumps(cfg)],
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
        env = dict(os.environ)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [package_parent] + [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        iface = _loopback_interface()
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface, PYTHONUNBUFFERED="1",
                   MPLBACKEND=env.get("MPLBACKEND", "agg"))
        env.pop("MASTER_PORT", None)
        env.update({k: str(v) for k, v in self.env.items()})
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
            zygote_dead = self.proc.poll() is not None and len(self.exits) < self.world_size
            if (self.failed_ranks() or zygote_dead) and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and (time.monotonic() - first_failure > GRACE_S
                                              or len(self.exits) == self.world_size or zygote_dead):
                self.drain(0.2)
                raise self.failure_error()
            if time.monotonic() > deadline:
                raise self.timeout_error()

    # -- results and errors ----------------------------------------------------------------------
    def results(self) -> list:
        out = []
        for rank in range(self.world_size):
            path = os.path.join(self.tmpdir, f"result_{rank}.pkl")
            if not os.path.exists(path):
                raise WorkerError(f"rank {rank} exited with code 0 but left no result (did it call os._exit?)",
                                  rank=rank, exitcode=0)
            with open(path, "rb") as f:
                out.append(cloudpickle.load(f))
        return out

    def _error_record(self, rank):
        path = os.path.join(self.tmpdir, f"error_{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                return cloudpickle.load(f)
        return None

    def failure_error(self) -> WorkerError:
        reports = []  # (is_comm_error, time, rank, description, traceback, code)
        for rank in self.failed_ranks():
            code, when = self.exits[rank]
            rec = self._error_record(rank)
            if rec is not None:
                comm = any(s in rec["summary"] for s in COMM_ERRORS)
                reports.append((comm, rec["time"], rank, f"raised {rec['summary']}", rec["traceback"], code))
            elif code < 0:
                reports.append((False, when, rank, f"was killed by {_signal_name(code)}", "", code))
            else:
                reports.append((False, when, rank, f"exited with code {code}", "", code))
        if not reports:
            tail = f" (zygote exit code {self.proc.returncode})" if self.proc.poll() is not None else ""
            return WorkerError(f"the worker launcher died before the ranks finished{tail}; see [launch] lines")
        reports.sort(key=lambda r: (r[0], r[1]))
        _, _, rank, what, tb, code = reports[0]
        others = [f"rank {r[2]} {r[3]}" for r in reports[1:]]
        msg = f"rank {rank} {what}"
        if others:
            msg += "\nthen: " + "; ".join(others)
        if tb:
            msg += f"\n\n--- remote traceback of rank {rank} ---\n{tb.rstrip()}"
        return WorkerError(msg, rank=rank, exitcode=code, remote_traceback=tb)

    def timeout_error(self) -> WorkerError:
        stuck = [r for r in range(self.world_size) if r not in self.exits]
        for rank in stuck:
            if rank in self.pids:
                try:
                    os.kill(self.pids[rank], signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        self.drain(0.05)
        stacks = {}
        for rank in stuck:
            path = os.path.join(self.tmpdir, f"stack_{rank}.txt")
            stacks[rank] = open(path).read().strip() if os.path.exists(path) else "(no stack: rank not started)"
        parts = [f"--- rank {r} stack ---\n{s}" for r, s in stacks.items()]
        return WorkerError(f"timed out after {self.timeout:g} s; ranks {stuck} had not finished "
                           f"(stuck in or never reaching a collective?)\n\n" + "\n\n".join(parts), stacks=stacks)

    # -- stop ------------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and every rank share its session
            except (ProcessLookupError, PermissionError):
                pass
            for pid in self.pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float = 300.0, threads: int | None = None,
           env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks with torch.distributed initialised.

    Returns the list of per-rank return values (tensors, dicts, notebook-defined classes...).
    ``backend``: "auto" (NCCL when CUDA has enough GPUs, else gloo), "gloo" or "nccl".
    ``timeout``: seconds for the whole call; stuck ranks are then reported with their stacks.
    ``threads``: torch threads per rank (default: cores // world_size, at least 1).
    ``env``: extra environment variables for the ranks (e.g. ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``).
    Raises WorkerError naming the first failing rank with its remote traceback.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if timeout is None or timeout <= 0:
        raise ValueError("timeout must be a positive number of seconds (a launch must never hang)")
    backend = default_backend(world_size) if backend == "auto" else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA GPUs; none is available here (use backend='gloo')")
    payload = cloudpickle.dumps({"fn": fn, "args": args, "kwargs": kwargs, "sources": _cell_sources()})
    run = _Run(world_size, backend, float(timeout), threads, env)
    try:
        run.start(payload)
        return run.wait()
    finally:
        run.stop()
