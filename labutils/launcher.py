"""Run a function on local distributed workers from a notebook cell. (Taught in chapter 00.)

    from . import launch

    def hello(scale):
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0]) * scale
        dist.all_reduce(t)
        return t.item()

    launch(hello, 4, 10.0)   # -> [100.0, 100.0, 100.0, 100.0]

How it works (and why): `torch.multiprocessing.spawn` cannot unpickle a function defined in a notebook,
`fork` of the kernel deadlocks once it has run a matmul and cannot carry CUDA, and `torchrun` is slow and
orphans workers when killed. So `launch` ships the function *by value* (cloudpickle) to a fresh
interpreter (labutils/_worker.py) that imports torch once and forks one process per rank before any tensor
op runs. Ranks meet through a FileStore in a temporary directory: no port is chosen by us, so no race, and
gloo is bound to the loopback interface. Each rank's output appears in the cell prefixed with its rank.
A rank that raises or dies stops the whole launch within about a second with a `WorkerError`; a rank
stuck at the timeout is reported with its Python stack; ranks waiting in different collectives (rank 0
all_reduce, rank 1 all_gather) are reported after ``MISMATCH_S`` seconds, each rank's call named. Nothing
outlives the call: the ranks die with the zygote, and the zygote, a subreaper, kills every process below it
(a rank's child in a new session too) when the ranks are done, when the launch stops, or when the caller
dies, and then removes the launch directory of a dead caller; a directory left anyway (the zygote killed
too) is swept by the next launch, which checks whether its owner process is still alive.

The same function runs unchanged under torchrun through ``python -m labutils.torchrun`` (see that module).
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import io
import json
import linecache
import math
import mmap
import numbers
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ._worker import SLOT_BYTES, descendants, read_calls
from .optional import HINTS

__all__ = ["launch", "WorkerError", "worker_info", "default_backend"]

GRACE_S = 1.0  # after the first failure, how long to wait for the others' reports before killing them
NOTEBOOK_TIMEOUT_S, SCRIPT_TIMEOUT_S = 120.0, 300.0  # the default timeout inside a Jupyter kernel / elsewhere
STDERR_TAIL = 20  # last stderr lines kept per rank, shown when a rank is killed by a signal
TMP_PREFIX = "labutils-launch-"
MISMATCH_S = 2.0  # every live rank this long in a different collective of the default group: a mismatch
STOP_GRACE_S = 5.0  # how long stop() lets the zygote kill what is below it before killing it itself
COMM_ERRORS = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket Timeout",
               "Gloo connectFullMesh failed", "NCCL communicator was aborted")


class WorkerError(RuntimeError):
    """A rank raised, died or got stuck. ``rank`` is the first failing rank (None at a timeout and when the ranks
    wait in different collectives).

    ``exitcode`` is the rank's exit code (negative: killed by that signal), ``remote_traceback`` its
    traceback and ``stacks`` the Python stacks of the ranks that were stuck at a timeout.
    """

    def __init__(self, message, rank=None, exitcode=None, remote_traceback="", stacks=None):
        super().__init__(message)
        self.rank, self.exitcode, self.remote_traceback = rank, exitcode, remote_traceback
        self.stacks = stacks or {}


def _cloudpickle():
    """cloudpickle, imported when a launch needs it (``import labutils`` and ``labutils.moe`` work without)."""
    try:
        import cloudpickle
    except ImportError as exc:
        raise ImportError(f"launch needs cloudpickle to ship a function to its workers, and it cannot be "
                          f"imported ({exc}): {HINTS['cloudpickle']}") from exc
    return cloudpickle


def in_notebook() -> bool:
    """True inside a Jupyter (IPython) kernel."""
    shell = sys.modules.get("IPython")
    get_ipython = getattr(shell, "get_ipython", None)
    ip = get_ipython() if callable(get_ipython) else None
    return ip is not None and getattr(ip, "kernel", None) is not None


def default_timeout() -> float:
    """The timeout of a launch that names none: 120 s in a notebook kernel (a hang blocks the notebook, and
    the book's workers take seconds), 300 s elsewhere."""
    return NOTEBOOK_TIMEOUT_S if in_notebook() else SCRIPT_TIMEOUT_S


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

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("worker_info() describes the rank it runs on, and no torch.distributed process group "
                           "is initialised here: call it inside the function you run with "
                           "labutils.launch(fn, world_size) (or under python -m labutils.torchrun), not in the "
                           "notebook or script that starts the launch")
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


def _payload(fn, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle of ``{fn, args, kwargs, sources}``; ``sources`` holds only the notebook cells the pickled
    code refers to (for tracebacks), never the rest of the session's cells. Unpicklable arguments are named."""
    cloudpickle = _cloudpickle()
    call = {"fn": fn, "args": args, "kwargs": kwargs}
    try:
        body = cloudpickle.dumps(call)
    except Exception as exc:
        raise TypeError(_unpicklable(cloudpickle, call, exc)) from exc
    sources = {name: lines for name, lines in _cell_sources().items() if name.encode() in body}
    return cloudpickle.dumps({**call, "sources": sources})


def _unpicklable(cloudpickle, call: dict, exc: Exception) -> str:
    """Which of fn / args / kwargs cannot be pickled, and why."""
    parts = [("fn", call["fn"])] + [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(call["args"])]
    parts += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in call["kwargs"].items()]
    for what, value in parts:
        try:
            cloudpickle.dumps(value)
        except Exception as why:
            return (f"launch cannot send {what} to the workers: it cannot be pickled ({type(why).__name__}: "
                    f"{why}). Workers are separate processes: pass plain data (tensors, numbers, dicts) and "
                    "create locks, open files, sockets or generators inside the worker function")
    return f"launch cannot pickle the call for the workers: {type(exc).__name__}: {exc}"


def _check_arguments(world_size, timeout, threads, env, args, kwargs) -> float:
    """Every argument of ``launch`` checked before anything starts; returns the timeout in seconds."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 (torch threads per rank) or None, got {threads!r}")
    if timeout is None:
        timeout = default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (a launch must never hang), "
                         f"got {timeout!r}")
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        bad = env if not isinstance(env, dict) else {k: v for k, v in env.items()
                                                    if not (isinstance(k, str) and isinstance(v, str))}
        raise TypeError(f"env must be a dict of str -> str (environment variables for the ranks), got {bad!r}")
    for what, value in [(f"argument {i}", a) for i, a in enumerate(args)] + \
                       [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]:
        if isinstance(value, io.IOBase):
            raise TypeError(f"launch cannot send {what}, an open file ({value!r}), to the workers: each worker "
                            "would get a copy or nothing, never the same file. Pass its path and open it in the "
                            "worker function")
    return float(timeout)


def _check_call(fn, world_size, args: tuple, kwargs: dict, own: dict) -> None:
    """``fn(*args, **kwargs)`` must bind to ``fn``'s signature before any process starts. A parameter of ``fn``
    named like one of launch's own keywords (``own``: those given) that nothing fills gets pointed to
    ``fn_kwargs``: ``launch(fn, 2, threads=1)`` sets launch's threads, not fn's."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: the ranks will tell
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        taken = {k: v for k, v in own.items() if k in sig.parameters and k not in kwargs}
        if taken:
            given = ", ".join(f"{k}={v!r}" for k, v in taken.items())
            raise TypeError(
                f"launch(fn, {world_size}, {given}): {given} went to launch itself (its own "
                f"keyword{'s' if len(taken) > 1 else ''}: {', '.join(taken)}), so {name}{sig} gets no "
                f"{', '.join(repr(k) for k in taken)} ({exc}). To pass {'them' if len(taken) > 1 else 'it'} to "
                f"fn, use fn_kwargs: launch(fn, {world_size}, fn_kwargs={taken!r})") from None
        raise TypeError(f"launch cannot call {name}{sig} with the arguments given: {exc} "
                        f"({len(args)} positional, keywords {sorted(kwargs)}); nothing was started") from None


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


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _exit_call(summary: str) -> str:
    """``SystemExit(0)`` (a rank's error summary) -> ``called sys.exit(0)``."""
    return "called sys.exit" + summary[len("SystemExit"):] if summary.startswith("SystemExit(") else summary


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _package_root() -> str:
    """The folder to put on the ranks' path so that this package imports under its own name, whatever that
    is: ``labutils``, a renamed ``mylab``, or a nested ``vendor.labutils`` (then the folder above vendor/).
    A notebook that changed directory after importing it still finds it."""
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in (__package__ or __name__.rpartition(".")[0]).split("."):
        root = os.path.dirname(root)
    return root


# The zygote runs _worker.py by its path, not as ``-m labutils._worker``: a renamed (``mylab/``) or nested copy
# of the package, or one imported from a path not on sys.path, starts the same way, and run_path does not put
# the package's own folder on sys.path (its models.py must not shadow a user's ``models`` module).
_RUN_WORKER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class _Run:
    """The state of one launch: processes, pipes, output and events."""

    def __init__(self, world_size, backend, timeout, threads, env, debug=False):
        self.world_size, self.timeout, self.debug = world_size, timeout, debug
        sweep_stale_dirs()
        self.tmpdir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        with open(os.path.join(self.tmpdir, "owner.json"), "w") as f:
            json.dump({"pid": os.getpid(), "start": _start_time(os.getpid()) or "?"}, f)
        self.stderr_tail: dict = collections.defaultdict(lambda: collections.deque(maxlen=STDERR_TAIL))
        self.events: queue.Queue = queue.Queue()
        self.pids, self.exits, self.errors = {}, {}, {}
        self.proc: subprocess.Popen | None = None
        self.calls: mmap.mmap | None = None
        self._watched: tuple | None = None  # (the ranks' calls, since when) while every live rank is in one
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) // world_size)
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
        env = dict(os.environ)
        paths = [_package_root()] + [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        iface = _loopback_interface()
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface, PYTHONUNBUFFERED="1",
                   MPLBACKEND=env.get("MPLBACKEND", "agg"))
        env.pop("MASTER_PORT", None)
        if self.debug:  # torch checks every collective's op, shapes and dtypes against the other ranks first
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
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

    def mismatch(self) -> WorkerError | None:
        """A WorkerError when every live rank has sat ``MISMATCH_S`` seconds in the same call of a collective
        of the default group and the collectives differ (they would wait for each other forever)."""
        live = [r for r in range(self.world_size) if r not in self.exits]
        if self.calls is None or len(live) < 2:
            return None
        calls = read_calls(self.calls, self.world_size)
        now = {r: calls[r] for r in live}
        if not all(inside and world for _, inside, _, world, _ in now.values()) \
                or len({text.split("(", 1)[0] for *_, text in now.values()}) < 2:
            self._watched = None
            return None
        key = tuple((r, c[0], c[4]) for r, c in now.items())
        if self._watched is None or self._watched[0] != key:
            self._watched = (key, time.monotonic())
            return None
        waited = time.monotonic() - self._watched[1]
        if waited < MISMATCH_S:
            return None
        stacks = self.stacks(live)
        calls_text = "; ".join(f"rank {r} is in {text} (its collective call #{seq})"
                               for r, (seq, _, _, _, text) in now.items())
        hint = "" if self.debug else (" launch(..., debug=True) makes torch compare every call's op and shapes "
                                      "as it happens.")
        msg = (f"the ranks called different collectives and would wait for each other until the timeout "
               f"({self.timeout:g} s): {calls_text}. Every rank must call the same collectives in the same "
               f"order (stopped after {waited:.1f} s with no rank moving on; MISMATCH_S = {MISMATCH_S:g}).{hint}"
               "\n\n" + "\n\n".join(f"--- rank {r} stack ---\n{s}" for r, s in stacks.items()))
        return WorkerError(msg, stacks=stacks)

    def stacks(self, ranks: list) -> dict:
        """The Python stacks of ``ranks`` (faulthandler, on SIGUSR1)."""
        for rank in ranks:
            if rank in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[rank], signal.SIGUSR1)
        time.sleep(0.5)
        self.drain(0.05)
        stacks = {}
        for rank in ranks:
            path = os.path.join(self.tmpdir, f"stack_{rank}.txt")
            stacks[rank] = _read(path).strip() if os.path.exists(path) else "(no stack: rank not started)"
        return stacks

    # -- results and errors ----------------------------------------------------------------------
    def results(self) -> list:
        out = []
        for rank in range(self.world_size):
            path = os.path.join(self.tmpdir, f"result_{rank}.pkl")
            if not os.path.exists(path):
                rec = self._error_record(rank)
                how = _exit_call(rec["summary"]) if rec is not None else "called os._exit(0)?"
                raise WorkerError(f"rank {rank} exited with code 0 but left no result: it {how} instead of "
                                  "returning", rank=rank, exitcode=0, remote_traceback=rec["traceback"] if rec else "")
            with open(path, "rb") as f:
                out.append(pickle.load(f))
        return out

    def _error_record(self, rank):
        path = os.path.join(self.tmpdir, f"error_{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
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
            proc = self.proc
            tail = f" (zygote exit code {proc.returncode})" if proc is not None and proc.poll() is not None else ""
            return WorkerError(f"the worker launcher died before the ranks finished{tail}; see [launch] lines")
        reports.sort(key=lambda r: (r[0], r[1]))
        _, _, rank, what, tb, code = reports[0]
        msg = f"rank {rank} {what}"
        left = self._left_early() if reports[0][0] else []
        if left:  # the peers only saw a closed connection: name the rank that left first, and how
            r, how = left[0]
            msg = (f"rank {r} {how} while the other ranks still waited for it in a collective; "
                   f"then rank {rank} {what}")
            rank, code = r, self.exits[r][0]
        others = [f"rank {x[2]} {x[3]}" for x in reports[1:]]
        if others:
            msg += "\nthen: " + "; ".join(others)
        for r in sorted({x[2] for x in reports if x[5] < 0} | ({rank} if code < 0 else set())):
            if self.stderr_tail.get(r):
                msg += f"\n\n--- last stderr lines of rank {r} ---\n" + "\n".join(self.stderr_tail[r])
        if tb:
            msg += f"\n\n--- remote traceback of rank {reports[0][2]} ---\n{tb.rstrip()}"
        return WorkerError(msg, rank=rank, exitcode=code, remote_traceback=tb)

    def _left_early(self) -> list:
        """Ranks that finished without an error (returned, or ``sys.exit(0)``) while others failed, first
        first, with what they did."""
        done = sorted((when, r) for r, (code, when) in self.exits.items() if code == 0)
        out = []
        for _, r in done:
            rec = self._error_record(r)
            how = _exit_call(rec["summary"]) if rec is not None else "returned from the function"
            out.append((r, f"{how} (exit code 0)"))
        return out

    def timeout_error(self) -> WorkerError:
        stuck = [r for r in range(self.world_size) if r not in self.exits]
        stacks = self.stacks(stuck)
        parts = [f"--- rank {r} stack ---\n{s}" for r, s in stacks.items()]
        hint = "" if self.debug else ("\nIf the ranks called different collectives (say rank 0 all_reduce, "
                                      "rank 1 broadcast), launch(..., debug=True) reports that at once.")
        return WorkerError(f"timed out after {self.timeout:g} s; ranks {stuck} had not finished "
                           f"(stuck in or never reaching a collective?){hint}\n\n" + "\n\n".join(parts),
                           stacks=stacks)

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


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float | None = None,
           threads: int | None = None, env: dict | None = None, debug: bool = False, fn_kwargs: dict | None = None,
           **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks with torch.distributed initialised.

    Returns the list of per-rank return values (tensors, dicts, notebook-defined classes...).
    ``backend``: "auto" (NCCL when CUDA has enough GPUs, else gloo), "gloo" or "nccl".
    ``timeout``: seconds for the whole call, a finite number > 0; stuck ranks are then reported with their
    stacks. Default: 120 s inside a Jupyter kernel (a hung cell blocks the notebook), 300 s elsewhere.
    ``threads``: torch threads per rank, an int >= 1 (default: cores // world_size, at least 1).
    ``env``: extra environment variables for the ranks, a dict of str -> str.
    ``debug=True``: torch checks, before each collective, that every rank calls the same one with the same
    shapes and dtypes (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): a mismatch (rank 0 all_reduce, rank 1 broadcast)
    raises at once instead of hanging to the timeout. Costs an extra exchange per collective. Without it, ranks
    that sit ``MISMATCH_S`` (2) seconds in different collectives of the default group are still reported, each
    rank's call named (the collective watch: each rank publishes the collective it is in, see _worker.py).
    ``fn_kwargs``: keyword arguments for ``fn``, for a function whose keywords are named like launch's own
    (``launch(fn, 2, fn_kwargs={"timeout": 5})`` calls ``fn(timeout=5)``); merged with ``**kwargs``. A call
    that does not fit ``fn``'s signature is refused before anything starts (a TypeError that points to
    ``fn_kwargs`` when one of launch's own keywords took the value ``fn`` needed).
    Arguments travel by pickle (cloudpickle): each rank gets its own copy; open files are refused.
    Raises WorkerError naming the first failing rank with its remote traceback (a rank that returned or
    called ``sys.exit`` while the others waited for it in a collective is named as the one that left).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if fn_kwargs is not None:
        if not isinstance(fn_kwargs, dict) or not all(isinstance(k, str) for k in fn_kwargs):
            raise TypeError(f"fn_kwargs must be a dict of keyword arguments for fn, got {fn_kwargs!r}")
        both = sorted(set(fn_kwargs) & set(kwargs))
        if both:
            raise TypeError(f"keyword arguments {both} given both in fn_kwargs and directly")
        kwargs = {**kwargs, **fn_kwargs}
    own = {name: value for name, value, default in (("backend", backend, "auto"), ("timeout", timeout, None),
                                                    ("threads", threads, None), ("env", env, None),
                                                    ("debug", debug, False)) if value != default}
    timeout = _check_arguments(world_size, timeout, threads, env, args, kwargs)
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False, got {debug!r}")
    backend = default_backend(world_size) if backend == "auto" else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA GPUs; none is available here (use backend='gloo')")
    payload = _payload(fn, args, kwargs)
    _check_call(fn, world_size, args, kwargs, own)
    run = _Run(world_size, backend, timeout, threads, env, debug)
    try:
        run.start(payload)
        return run.wait()
    finally:
        run.stop()
