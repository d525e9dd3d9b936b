"""The worker side of `launch`: the zygote that forks the ranks, and each rank. Internal; see launcher.py.

The parent (launcher.py) starts this file by its path (``runpy.run_path``) in a fresh interpreter: it
imports nothing of its package, so a renamed or nested copy of the package launches the same way. The
zygote imports torch once and forks one child per rank *before* any tensor op has run in it (so fork is
safe: no OpenMP pool, no CUDA context), then waits for them. Each rank wires its output, dies with the
zygote, unpickles the user's function by value, joins the process group through a FileStore, runs, writes
its result or its traceback and leaves with ``os._exit``.

Channels between the parent, the zygote and the ranks:

| channel | direction | what travels |
|---|---|---|
| last argv | parent -> zygote | JSON config: world size, backend, tmpdir, store, threads, timeouts, fds |
| ``TMPDIR/payload.pkl`` | parent -> ranks | cloudpickle of ``{fn, args, kwargs, sources}`` (cells, for tracebacks) |
| ``TMPDIR/store`` | rank <-> rank | torch.distributed FileStore: the rendezvous (no port is chosen) |
| per-rank stdout/stderr pipes | rank -> parent | the rank's output, printed as ``[rank R] ...`` |
| zygote stdout | zygote -> parent | line protocol: ``pid RANK PID`` when forked, ``exit RANK CODE`` when reaped |
| zygote stderr | zygote -> parent | anything the zygote itself prints, shown as ``[launch] ...`` |
| ``TMPDIR/result_R.pkl`` | rank -> parent | the return value (written atomically) |
| ``TMPDIR/error_R.pkl`` | rank -> parent | ``{time, summary, traceback}`` of an exception or ``SystemExit`` |
| ``TMPDIR/stack_R.txt`` | rank -> parent | faulthandler stacks, written when the parent sends SIGUSR1 at a timeout |
| ``TMPDIR/calls.bin`` | ranks -> parent | shared memory, a 128-byte slot per rank: the collective it is in now |
| PDEATHSIG | kernel | a rank gets SIGKILL when the zygote dies; the zygote SIGUSR2 when the caller dies |

The collective watch: each rank's ``torch.distributed`` collectives (all_reduce, all_gather, broadcast, barrier,
...; not send/recv) are wrapped to write ``(call number, inside?, start time, default group?, "name(shapes)")``
into the rank's slot of ``calls.bin`` (a few microseconds a call). When every live rank has sat in a different
collective of the default group for ``MISMATCH_S`` seconds (rank 0 all_reduce, rank 1 all_gather: gloo waits
forever), the parent stops the launch naming each rank's call instead of waiting for the timeout.

Nothing outlives the launch: the zygote is a child subreaper (PR_SET_CHILD_SUBREAPER), so a process a rank
starts, even in a new session (``start_new_session=True``) and even after that rank died, stays below the
zygote; when the ranks are done, or the caller stops the launch or dies, the zygote kills every process below
it (walking /proc) and, when the caller died, removes the launch directory.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import linecache
import mmap
import os
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
from datetime import timedelta

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
CALL_SLOT = struct.Struct("<qqdq96s")  # call number, inside (0/1), start (monotonic s), default group (0/1), text
SLOT_BYTES = 128
CALLER_GONE = signal.SIGUSR2  # the zygote's PDEATHSIG (SIGTERM is the caller's stop())


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL, on_death=None) -> None:
    """Ask Linux to send ``sig`` when our parent dies; fall back to polling getppid elsewhere (then
    ``on_death()`` runs, or we exit)."""
    armed = _prctl(PR_SET_PDEATHSIG, int(sig))
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
            _reap()
        time.sleep(0.01)
    return killed


def _reap(wait_s: float = 0.0) -> None:
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


# -- the collective watch (runs in each rank) ----------------------------------------------------------
# Compiled under a file name outside this package: the wrappers sit between a user's function and torch, and
# the exercise checkers' guard (labbook.exercises) refuses calls into the package, so a student's own
# dist.all_gather must not look like one. The wrappers call nothing of the package.
_WATCH_FILE = "<launch collective watch>"
_WATCH_SOURCE = """
import functools, time

def _text(a, Tensor):
    if isinstance(a, Tensor):
        return str(tuple(a.shape)) + " " + str(a.dtype)[6:]
    if isinstance(a, (list, tuple)):
        return "list of " + str(len(a)) + (" of " + _text(a[0], Tensor) if a and isinstance(a[0], Tensor) else "")
    return type(a).__name__

def watch(dist, names, buf, offset, slot, Tensor):
    state = [0, 0]  # call number, depth (a collective calling another is one call)
    pack = slot.pack_into
    clock = time.monotonic

    def wrap(name, fn, group_at):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if state[1]:
                return fn(*args, **kwargs)
            state[0] += 1
            group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
            world = 1 if group is None or group is dist.GroupMember.WORLD else 0
            text = name + "(" + (_text(args[0], Tensor) if args else "")
            text = (text + (", " + _text(args[1], Tensor) if len(args) > 1 else "") + ")").encode()
            pack(buf, offset, state[0], 1, clock(), world, text)
            state[1] = 1
            try:
                return fn(*args, **kwargs)
            finally:
                state[1] = 0
                pack(buf, offset, state[0], 0, 0.0, world, text)
        return collective

    for name in names:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        try:
            params = list(__import__("inspect").signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        setattr(dist, name, wrap(name, fn, params.index("group") if "group" in params else None))
"""
WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
           "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
           "reduce_scatter_tensor", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
           "scatter_object_list")


def _watch_collectives(rank: int, cfg: dict) -> None:
    """Wrap this rank's torch.distributed collectives to publish the one it is in (see the module docstring)."""
    import torch
    import torch.distributed as dist

    path = os.path.join(cfg["tmpdir"], "calls.bin")
    if not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDWR)
    try:
        buf = mmap.mmap(fd, SLOT_BYTES * cfg["world_size"])
    finally:
        os.close(fd)
    space: dict = {}
    lines = [str(line) for line in _WATCH_SOURCE.splitlines(keepends=True)]
    linecache.cache[_WATCH_FILE] = (len(_WATCH_SOURCE), None, lines, _WATCH_FILE)
    exec(compile(_WATCH_SOURCE, _WATCH_FILE, "exec"), space)  # noqa: S102 (our own constant source)
    space["watch"](dist, WATCHED, buf, SLOT_BYTES * rank, CALL_SLOT, torch.Tensor)


def read_calls(buf, world_size: int) -> dict:
    """``rank -> (call number, inside, start, default group, text)`` from ``calls.bin`` (the parent's side)."""
    out = {}
    for rank in range(world_size):
        seq, inside, start, world, text = CALL_SLOT.unpack_from(buf, SLOT_BYTES * rank)
        out[rank] = (seq, bool(inside), start, bool(world), text.rstrip(b"\0").decode("utf-8", "replace"))
    return out


# -- one rank ------------------------------------------------------------------------------------

def _wire_output(rank: int, cfg: dict) -> None:
    os.dup2(cfg["out_fds"][rank], 1)
    os.dup2(cfg["err_fds"][rank], 2)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    # the rank's streams for its whole life (closed by os._exit), hence no `with`
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")  # noqa: SIM115


def _set_rank_env(rank: int, cfg: dict) -> None:
    world = cfg["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1")


def _install_sources(sources: dict) -> None:
    """Put notebook cell sources into linecache so remote tracebacks show the cell's lines."""
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _init_process_group(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    kwargs = {}
    if cfg["backend"] == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    store = dist.FileStore(cfg["store_path"], cfg["world_size"])  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=cfg["world_size"],
                            timeout=timedelta(seconds=cfg["pg_timeout"]), **kwargs)
    # Every rank's side of gloo's full mesh is connected before anyone runs fn: a rank whose fn needs no
    # collective could otherwise return and close its sockets while a peer is still connecting to it
    # ("connectFullMesh failed ... Connection closed by peer", seen on a loaded machine).
    dist.barrier()


def _write(path: str, obj) -> None:
    import cloudpickle

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(obj, f)
    os.replace(tmp, path)


def run_rank(rank: int, cfg: dict) -> None:
    """Run the user's function as ``rank``; never returns."""
    code = 1
    tmp = cfg["tmpdir"]
    try:
        _wire_output(rank, cfg)
        die_with_parent(os.getppid())
        stack_file = open(os.path.join(tmp, f"stack_{rank}.txt"), "w")  # noqa: SIM115 (open until os._exit)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        _set_rank_env(rank, cfg)
        import cloudpickle
        import torch

        torch.set_num_threads(cfg["threads"])
        with open(os.path.join(tmp, "payload.pkl"), "rb") as f:
            payload = cloudpickle.load(f)
        _install_sources(payload["sources"])
        _init_process_group(rank, cfg)
        _watch_collectives(rank, cfg)  # after init's own barrier: the watch counts the function's collectives only
        result = payload["fn"](*payload["args"], **payload["kwargs"])
        _write(os.path.join(tmp, f"result_{rank}.pkl"), result)
        _destroy()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        _record_error(tmp, rank, f"SystemExit({exc.code!r})", traceback.format_exc())
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        tb = exc.__traceback__
        tb = (tb.tb_next if tb is not None else None) or tb  # drop this module's own frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        _record_error(tmp, rank, f"{type(exc).__name__}: {exc}", text)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _record_error(tmp: str, rank: int, summary: str, tb: str) -> None:
    try:
        _write(os.path.join(tmp, f"error_{rank}.pkl"), {"time": time.time(), "summary": summary, "traceback": tb})
    except Exception:
        sys.stderr.write(tb)


# -- the zygote -----------------------------------------------------------------------------------

def main() -> None:
    cfg = json.loads(sys.argv[-1])
    zygote = os.getpid()

    def stop(signum=None, _frame=None):
        """SIGTERM: the caller's stop(); CALLER_GONE: the caller's thread that started us died (PDEATHSIG)."""
        if os.getpid() != zygote:  # a rank forked before it reset the handler: just die
            os._exit(1)
        kill_tree(zygote)
        _reap(2.0)
        if signum != signal.SIGTERM:
            # The signal comes when the caller's *thread* exits: when its whole process is gone we are handed
            # to another parent. Then nobody else removes the launch directory: do it here.
            deadline = time.monotonic() + 5.0
            while os.getppid() == cfg["parent_pid"] and time.monotonic() < deadline:
                time.sleep(0.02)
            if os.getppid() != cfg["parent_pid"]:
                shutil.rmtree(cfg["tmpdir"], ignore_errors=True)
        os._exit(0)

    for sig in (signal.SIGTERM, CALLER_GONE):
        signal.signal(sig, stop)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the ranks (new sessions included) stay below the zygote
    die_with_parent(cfg["parent_pid"], CALLER_GONE, on_death=stop)
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401  (imported once, shared by every forked rank)
    import torch.distributed  # noqa: F401

    pids = {}
    for rank in range(cfg["world_size"]):
        pid = os.fork()
        if pid == 0:
            for sig in (signal.SIGTERM, CALLER_GONE):
                signal.signal(sig, signal.SIG_DFL)
            run_rank(rank, cfg)  # never returns
        pids[pid] = rank
        print(f"pid {rank} {pid}", flush=True)
    for fd in cfg["out_fds"] + cfg["err_fds"]:
        os.close(fd)
    while pids:
        pid, status = os.waitpid(-1, 0)
        if pid in pids:  # else an orphan a rank left behind, reparented to us
            print(f"exit {pids.pop(pid)} {status_code(status)}", flush=True)
    kill_tree(zygote)  # what the ranks started and left running
    _reap(2.0)


if __name__ == "__main__":
    main()
