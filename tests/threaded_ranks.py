"""W ranks as W threads of THIS process: PyTorch's threaded process group (what its MultiThreadedTestCase uses).

    from threaded_ranks import run_ranks
    results = run_ranks(fn, 3, arg)        # fn(arg) on ranks 0, 1, 2 -> [result of rank 0, of rank 1, of rank 2]

Why: mutation testing (``make mutate``, tools/mutate.py) runs only the in-process tests and records which test
reaches which function in the pytest process alone, so code that runs only in ``labutils.launch`` workers (the
``dist`` tests: gloo, one process per rank) counts as untested there, and every mutant of a multi-rank branch
(``group=``, ``world_size > 1``, all_to_all, the agreement checks) survived. Here each rank is a thread running
``fn`` inside ``torch.distributed.init_process_group("threaded", ...)``, so the collectives, the checks around
them and autograd through them run in the test's own process, in a few milliseconds.

What it is not: the threaded group copies tensors between threads; it has no wire, no gloo framing, no timeouts
or SIGABRT of its own, and ranks that call DIFFERENT collectives at once are paired anyway (garbage, or an error
on rank 0) instead of hanging or aborting as gloo does; rank 0 does the copying of every collective, so data that
does not fit (shapes, split sizes) raises there, and when the test catches that error the other ranks wait for the
timeout. The real gloo tests (marked ``dist``: tests/test_dist.py,
test_moe_parallel.py, test_data_parallel.py, test_fastmoe_dist.py, test_bad_input_ranks.py) stay the reference
for the wire, for what gloo does with mismatched calls and for the launcher; these tests cover the same
behaviour in-process. State that is per process with W processes is shared by W threads here (torch's global
RNG, module-level counters such as ``expert_parallel``'s first-call layer ids): give each rank its inputs,
and layers explicit ids.

``run_ranks`` re-raises the lowest rank's exception (its type kept, so ``pytest.raises`` works; a note names the
rank) and fails with :class:`RanksTimedOut`, naming the ranks that did not finish and where they wait, when
``timeout`` seconds pass (a collective some rank never joins), instead of hanging the test run.
"""
from __future__ import annotations

import datetime
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

__all__ = ["run_ranks", "RanksTimedOut", "TIMEOUT"]

# A good run takes milliseconds; a stuck collective fails after this, well inside mutmut's per-test limit (30 s
# plus 15 times the test's recorded time), so a mutant that hangs the ranks counts as killed, not as a timeout.
TIMEOUT = 10.0
_ONE_AT_A_TIME = threading.Lock()


class RanksTimedOut(TimeoutError):
    """Some ranks did not finish within the timeout (a collective that not every rank joined)."""


def _where(thread: threading.Thread) -> str:
    """The innermost frames of ``thread`` outside torch.distributed's own code: where that rank waits."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "?"
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if "/torch/" not in f.filename and not f.filename.endswith(("threading.py", __file__))]
    return " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(ours[-3:]))


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT, **kwargs) -> list:
    """``fn(*args, **kwargs)`` on ``world`` ranks of a threaded process group; returns their results by rank.

    Inside ``fn`` the default process group is this rank's (``dist.get_rank()``, ``dist.get_world_size()``,
    ``dist.new_group``, every collective), as in a ``labutils.launch`` worker. A rank that raises: the others
    are released from any collective they wait in, and the lowest raising rank's exception is re-raised with a
    note naming the rank (and the other ranks' errors). A rank still running after ``timeout`` seconds:
    :class:`RanksTimedOut` naming the ranks that did not finish and the frames they wait in.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"run_ranks: world must be an int >= 1, got {world!r}")
    if not _ONE_AT_A_TIME.acquire(timeout=timeout):
        raise RanksTimedOut(f"run_ranks: another run_ranks still holds the threaded group after {timeout} s")
    results: list = [None] * world
    errors: dict = {}
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    ProcessLocalGroup.reset()

    def rank_body(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store,
                                    timeout=datetime.timedelta(seconds=timeout))
            results[rank] = fn(*args, **kwargs)
        except SystemExit:          # released from a collective because another rank raised or the run timed out
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            ProcessLocalGroup.exception_handle(exc)   # wake the ranks waiting for this one in a collective
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group torn down mid-collective; nothing left to free
                pass

    threads = [threading.Thread(target=rank_body, args=(r,), name=f"rank {r}", daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            where = {r: _where(threads[r]) for r in stuck}
            ProcessLocalGroup.exception_handle(RanksTimedOut())   # release what waits in a collective
            released = time.monotonic() + 0.5
            for r in stuck:
                threads[r].join(max(0.0, released - time.monotonic()))
            done = [r for r in range(world) if r not in stuck]
            raised = "".join(f"; rank {r} raised {type(e).__name__}: {e}" for r, e in sorted(errors.items()))
            raise RanksTimedOut(
                f"run_ranks: rank{'s' * (len(stuck) > 1)} {', '.join(map(str, stuck))} of {world} did not finish "
                f"within {timeout} s (a collective that not every rank joined?); finished: {done or 'none'}"
                + raised + "".join(f"\n  rank {r} was in: {w}" for r, w in where.items()))
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        ProcessLocalGroup.reset()
        _ONE_AT_A_TIME.release()
    if errors:
        rank = min(errors)
        exc = errors[rank]
        others = "".join(f"; rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items()) if r != rank)
        note = f"(raised on rank {rank} of {world}, threaded process group{others})"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python 3.10: no notes in tracebacks, but the attribute is still there to read
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # pyright: ignore[reportAttributeAccessIssue]
        raise exc
    return results
