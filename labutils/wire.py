"""Bytes on the wire, counted by the kernel below every Python API. (Taught in chapter 06.)

``with count_wire() as w: ...`` reads ``TCP_INFO`` of every TCP socket this process holds (gloo's connections
to the other ranks, the rendezvous store) before and after the block, so ``w.sent`` / ``w.received`` are
the payload bytes the kernel carried for this process in between, whoever asked for them: the lab's
all-to-all, a stray ``dist.all_to_all_single``, a library's padded buffer, a barrier. Loopback gloo is the
case this serves (a rank's rows to itself never reach a socket). It sees TCP only: NCCL over NVLink or
InfiniBand, or shared memory, is invisible to it, and :func:`tcp_counters` raises when the process holds no
TCP socket at all.

Counts include the transport's own framing (gloo writes a fixed header per message), so compare two counts
of the same sequence of collectives (a call with no rows, a call with rows) rather than a count with a
payload computed on paper. ``sent`` counts each byte the process handed to the kernel once (transmitted,
minus TCP's retransmissions, which loopback makes too when a delayed ACK trips the tail-loss probe, plus
bytes still queued); ``received`` counts what has arrived. Neither is complete the instant the block ends.

Three things the kernel's counters of open sockets cannot see on their own, and what ``count_wire`` does about each:

* bytes a transport thread hands to the kernel *after* the block's last line (gloo writes from its own thread): on
  leaving the block the counters are read again, after pauses of 0.5, 1, 2, 4, 5, 5 ... ms, until a re-read finds
  them unchanged while no other thread of the process is running or runnable (only a thread of this process can
  hand it bytes to send, and a sleeping one needs an event to wake it first), or until they have not moved for
  ``settle`` seconds, whichever comes first (``w.settled`` says whether either happened within ``max_wait``). A
  count after a collective usually ends at the first re-read, within a millisecond, instead of waiting ``settle``;
* a connection closed inside the block (a process group made and destroyed in it): its counters are gone when the
  block ends. ``w.closed`` counts the connections open at the start and gone at the end. Gloo closes its end when
  a peer leaves, so a rank that finishes first can take bytes out of a slower rank's count (chapter 06 saw counts
  1.5-2 kB short this way under load): keep every rank in, e.g. a barrier after the block, until all have
  counted. One opened and closed inside the block needs a rendezvous through the store first, which the next item
  sees;
* the rendezvous store, a side channel between the ranks: with ``labutils.launch``'s FileStore it is a file, not a
  socket. ``w.store`` is the bytes appended to it during the block: this rank's writes, and any other rank's that
  landed meanwhile (a TCPStore's socket is counted in ``sent`` / ``received`` instead, and ``w.store`` is 0).

Only the calling process's sockets are read, so count inside a rank: in the worker function that ``launch`` runs
(``def fn(): with count_wire() as w: ...; return w.sent``). ``count_wire()`` refuses to start in a process that is
not a rank (torch.distributed not initialised there), such as the notebook kernel around a ``launch``: the
ranks send from their own processes, so the kernel's count would be 0, or the kernel's own traffic. ``w.sent``,
``w.received``, ``w.store``, ``w.closed`` and ``w.settled`` exist once the ``with`` block has ended; read earlier,
or without ``with``, they raise. A counter entered again inside its own block, and ``settle`` / ``max_wait`` that
are not finite numbers of seconds with 0 <= settle <= max_wait, are refused.
"""
from __future__ import annotations

import math
import numbers
import os
import socket
import struct
import sys
import threading
import time

__all__ = ["tcp_counters", "count_wire", "WireCount"]

# struct tcp_info (linux/tcp.h): u64 tcpi_bytes_received at 128, u32 tcpi_notsent_bytes at 144,
# u64 tcpi_bytes_sent at 200 and tcpi_bytes_retrans at 208 (Linux >= 4.19)
_RECEIVED, _NOTSENT, _SENT, _RETRANS, _NEEDED = 128, 144, 200, 208, 216


def tcp_counters() -> dict:
    """``{socket inode: (bytes sent or queued, bytes received)}`` over this process's TCP sockets.

    Raises RuntimeError when the process holds no TCP socket (nothing to count: not a gloo rank, or a
    transport other than TCP) or the kernel's ``TCP_INFO`` lacks ``tcpi_bytes_sent`` (Linux < 4.19)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while we listed
            continue
        if not link.startswith("socket:"):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))  # a duplicate: closing it leaves the owner's fd open
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        finally:
            sock.close()
        if len(info) < _NEEDED:
            raise RuntimeError(f"count_wire: this kernel's TCP_INFO has {len(info)} bytes, without "
                               "tcpi_bytes_sent (Linux >= 4.19 needed)")
        sent = (struct.unpack_from("Q", info, _SENT)[0] - struct.unpack_from("Q", info, _RETRANS)[0]
                + struct.unpack_from("I", info, _NOTSENT)[0])            # each byte once, queued ones too
        out[link] = (sent, struct.unpack_from("Q", info, _RECEIVED)[0])
    if not out:
        raise RuntimeError("count_wire: this process holds no TCP socket, so there is no wire to count "
                           "(call it inside a gloo rank; NCCL and shared-memory transports are not seen)")
    return out


class WireCount:
    """The counter of :func:`count_wire`: ``sent`` and ``received`` bytes (ints), set when the block ends, and
    ``store`` (bytes appended to the rendezvous store), ``closed`` (connections gone by the end) and ``settled``."""

    def __init__(self, settle: float = 0.05, max_wait: float = 5.0):
        for arg, value in (("settle", settle), ("max_wait", max_wait)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"count_wire: {arg} must be a number of seconds, got {value!r}")
            if not math.isfinite(value):
                why = (" (the count would wait forever for a socket that never goes quiet)"
                       if arg == "max_wait" and value == math.inf else "")
                raise ValueError(f"count_wire: {arg} must be a finite number of seconds, got {value!r}{why}")
        if not 0 <= settle <= max_wait:
            raise ValueError(f"count_wire: need 0 <= settle <= max_wait, got settle={settle!r}, max_wait={max_wait!r}")
        self.settle, self.max_wait = float(settle), float(max_wait)
        self._counts: tuple | None = None   # (sent, received) once a block has ended
        self._before: dict | None = None    # this process's counters while a block runs
        self._store_before = 0
        self._extra: tuple | None = None    # (store, closed, settled) once a block has ended

    def __enter__(self):
        if self._before is not None:
            raise RuntimeError("count_wire: this counter is already counting (a `with w:` inside its own `with "
                               "count_wire() as w:` block): entering it again would restart its count and lose the "
                               "outer one. Nest a second counter instead: with count_wire() as inner: ...")
        _require_rank()
        self._store_before = _store_bytes()
        self._before = tcp_counters()
        return self

    def __exit__(self, *exc):
        before = self._before or {}
        zero = (0, 0)  # a connection opened inside the block counts from zero

        def totals(after):
            return (sum(a[0] - before.get(k, zero)[0] for k, a in after.items()),
                    sum(a[1] - before.get(k, zero)[1] for k, a in after.items()))

        after = tcp_counters()
        counts, start = totals(after), time.monotonic()
        quiet_since, pause, still = start, _FIRST_PAUSE, False   # still: unchanged over a re-read, no thread running
        while self.settle > 0 and not still and time.monotonic() - quiet_since < self.settle \
                and time.monotonic() - start < self.max_wait:
            time.sleep(min(pause, self.settle))
            pause = min(2 * pause, _LAST_PAUSE)
            after = tcp_counters()
            now = totals(after)
            if now != counts:                # still moving: a late message reached the kernel
                counts, quiet_since, pause = now, time.monotonic(), _FIRST_PAUSE
            else:
                still = not _other_threads_running()
        settled = still or time.monotonic() - quiet_since >= self.settle
        self._counts = counts
        self._extra = (_store_bytes() - self._store_before, len(set(before) - set(after)), settled)
        self._before = None
        return False

    @property
    def sent(self) -> int:
        """Bytes this process's sockets sent (or queued) during the block."""
        return self._result()[0]

    @property
    def received(self) -> int:
        """Bytes this process's sockets received during the block."""
        return self._result()[1]

    @property
    def store(self) -> int:
        """Bytes appended to the rendezvous FileStore during the block (0 for any other store)."""
        self._result()
        assert self._extra is not None
        return self._extra[0]

    @property
    def closed(self) -> int:
        """Connections open when the block started and gone when it ended."""
        self._result()
        assert self._extra is not None
        return self._extra[1]

    @property
    def settled(self) -> bool:
        """Whether the count settled within ``max_wait`` (see :func:`count_wire` for when it does)."""
        self._result()
        assert self._extra is not None
        return self._extra[2]

    def _result(self) -> tuple:
        if self._before is not None:
            raise RuntimeError("count_wire: w.sent / w.received (and w.store, w.closed, w.settled) are read inside "
                               "the `with count_wire() as w:` block; they are set when the block ends: read them "
                               "after it")
        if self._counts is None:
            raise RuntimeError("count_wire: this counter was never entered, so it counted nothing (not 0 bytes): "
                               "use `with count_wire() as w: ...` and read w.sent / w.received (w.store, w.closed, "
                               "w.settled) after the block")
        return self._counts

    def __repr__(self):
        if self._counts is None:
            return "WireCount(not counted: use `with count_wire() as w:`)"
        return f"WireCount(sent={self._counts[0]}, received={self._counts[1]})"


_FIRST_PAUSE, _LAST_PAUSE = 0.0005, 0.005  # seconds between re-reads of the counters: doubling, then capped


def _other_threads_running() -> bool:
    """Whether a thread of this process other than the caller is running or runnable (``R``) or in an
    uninterruptible wait (``D``), from ``/proc/self/task/*/stat``: such a thread may be about to hand bytes to a
    socket. True when the states cannot be read (the caller then waits the whole ``settle``)."""
    me = str(threading.get_native_id())
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for tid in tasks:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(b")") + 2:][:1] in (b"R", b"D"):  # the state follows "pid (comm) "
            return True
    return False


def _store_bytes() -> int:
    """Size in bytes of the default process group's FileStore (0 for any other store: a TCPStore's socket is
    counted with the others)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return 0
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return 0
    while hasattr(store, "underlying_store"):  # PrefixStore around the real one
        store = store.underlying_store
    path = getattr(store, "path", None)
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _require_rank() -> None:
    """Refuse to count in a process that is not a distributed rank (see the module docstring)."""
    dist = sys.modules.get("torch.distributed")  # not imported: certainly not a rank
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "count_wire() counts the TCP sockets of the process that calls it, and this process is not a rank "
            "(torch.distributed is not initialised here). Around labutils.launch(...) it would report 0 bytes (or "
            "this process's own traffic, e.g. a Jupyter kernel's), because each rank sends from its own process, "
            "whose sockets are not visible from here. Count inside the worker function instead: def fn(): with "
            "count_wire() as w: ...; return w.sent, then launch(fn, world_size)")


def count_wire(settle: float = 0.05, max_wait: float = 5.0) -> WireCount:
    """``with count_wire() as w: ...`` then ``w.sent`` / ``w.received``: TCP payload bytes this process's
    sockets carried during the block (see the module docstring for what is and is not seen), read when a re-read
    finds them unchanged while no other thread of the process runs, or when they have not moved for ``settle``
    seconds (at most ``max_wait``: ``w.settled``; ``settle=0``: no re-read); ``w.store``: bytes appended to the
    rendezvous FileStore meanwhile; ``w.closed``: connections that closed in the block. Inside a rank only:
    raises RuntimeError in a process without a process group (around a ``launch``, count in the worker function),
    when ``w.sent`` (or any count) is read before the block ended or without ``with``, and when the counter is
    entered again inside its own block; TypeError / ValueError for ``settle`` / ``max_wait`` not finite numbers of
    seconds with 0 <= settle <= max_wait."""
    return WireCount(settle, max_wait)
