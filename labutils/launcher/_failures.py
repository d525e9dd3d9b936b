"""How a launch ends, in words: the ranks' results, or a :class:`WorkerError` naming the first failing rank, the
ranks stuck at the timeout (with their stacks) or the different collectives the ranks wait in. Internal; the
parent side of ``launch`` (chapter 00).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from typing import Any, Callable

from ._watch import read_calls

MISMATCH_S = 2.0  # every live rank this long in a different collective of the default group: a mismatch
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


def _load_result(path: str, rank: int):
    """Rank ``rank``'s return value, unpickled here: a value of a module only the ranks can import is named."""
    with open(path, "rb") as f:
        try:
            return pickle.load(f)
        except ImportError as exc:
            module = exc.name or str(exc)
            raise WorkerError(
                f"rank {rank} returned a value that cannot be unpickled here: it needs the module {module!r}, which "
                f"the ranks can import but this process cannot ({type(exc).__name__}: {exc}). A launch's result "
                "must be importable in the caller: return plain data (tensors, numbers, strings, lists, dicts), "
                f"or make {module!r} importable here too (sys.path) as well as in the ranks",
                rank=rank, exitcode=0) from exc
        except Exception as exc:  # noqa: BLE001 - e.g. a class the caller's version of the module lacks
            raise WorkerError(
                f"rank {rank} returned a value that cannot be unpickled here ({type(exc).__name__}: {exc}). A "
                "launch's result must be importable in the caller: return plain data (tensors, numbers, strings, "
                "lists, dicts)", rank=rank, exitcode=0) from exc


class Reports:
    """The reports of :class:`_run.Run`, which inherits them; they read its state (``world_size``, ``timeout``,
    ``debug``, ``tmpdir``, ``pids``, ``exits``, ``stderr_tail``, ``proc``, ``calls``, ``_watched``) and call its
    ``drain`` and ``failed_ranks``."""

    # what the reports read, all set by Run (declared here so each report type-checks on its own)
    world_size: int
    timeout: Any
    debug: bool
    tmpdir: Any
    pids: dict
    exits: dict
    stderr_tail: dict
    proc: Any
    calls: Any
    _watched: tuple | None
    drain: Callable[[float], None]
    failed_ranks: Callable[[], list]

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

    def results(self) -> list:
        out = []
        for rank in range(self.world_size):
            path = os.path.join(self.tmpdir, f"result_{rank}.pkl")
            if not os.path.exists(path):
                rec = self._error_record(rank)
                how = _exit_call(rec["summary"]) if rec is not None else "called os._exit(0)?"
                raise WorkerError(f"rank {rank} exited with code 0 but left no result: it {how} instead of "
                                  "returning", rank=rank, exitcode=0, remote_traceback=rec["traceback"] if rec else "")
            out.append(_load_result(path, rank))
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
            if rec is not None:
                how = f"{_exit_call(rec['summary'])} (exit code 0)"
            elif os.path.exists(os.path.join(self.tmpdir, f"result_{r}.pkl")):
                how = "returned from the function (exit code 0)"
            else:  # no result and no exception: the process ended itself (os._exit(0), a library's exit)
                how = "exited (status 0) without returning a result (os._exit(0)?)"
            out.append((r, how))
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
