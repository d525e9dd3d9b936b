"""labutils.wire in the pytest process (issue 38: mutation testing as the measure of the library's tests).

``count_wire`` is used inside ``labutils.launch`` workers (chapter 06, the ``dist`` tests), where no in-process unit
test reaches it, so mutmut found most of wire.py untested. Here every part runs in this process:

* ``tcp_counters`` on real loopback TCP pairs (exact byte counts read back from the kernel), and with the file
  descriptor listing or a socket's ``TCP_INFO`` answer scripted for what a test cannot make happen on demand (an fd
  closed while listed, a short or huge ``tcp_info``);
* ``count_wire``'s re-reads after the block with the counters, the other threads and the clock scripted, so the
  pause schedule, the ``settle`` / ``max_wait`` bounds and ``w.settled`` are exact and take no real time;
* ``_other_threads_running`` with ``/proc/self/task`` scripted (and once on a real thread hashing outside the GIL);
* ``_store_bytes`` on real FileStores behind PrefixStores, and a real one-rank gloo group over a FileStore;
* the refusals, pinned word for word.

Every process group made here is destroyed before the test ends (``torch.distributed.is_initialized()`` is False
after each test); "is a rank" is otherwise faked with monkeypatch, which pytest undoes.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import struct
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from labutils import wire
from labutils.wire import WireCount, count_wire

NOT_A_RANK = (
    "count_wire() counts the TCP sockets of the process that calls it, and this process is not a rank "
    "(torch.distributed is not initialised here). Around labutils.launch(...) it would report 0 bytes (or "
    "this process's own traffic, e.g. a Jupyter kernel's), because each rank sends from its own process, "
    "whose sockets are not visible from here. Count inside the worker function instead: def fn(): with "
    "count_wire() as w: ...; return w.sent, then launch(fn, world_size)")
NO_TCP = ("count_wire: this process holds no TCP socket, so there is no wire to count (call it inside a gloo rank; "
          "NCCL and shared-memory transports are not seen)")
READ_INSIDE = ("count_wire: w.sent / w.received (and w.store, w.closed, w.settled) are read inside the `with "
               "count_wire() as w:` block; they are set when the block ends: read them after it")
NEVER_ENTERED = ("count_wire: this counter was never entered, so it counted nothing (not 0 bytes): use `with "
                 "count_wire() as w: ...` and read w.sent / w.received (w.store, w.closed, w.settled) after the block")
ENTERED_AGAIN = ("count_wire: this counter is already counting (a `with w:` inside its own `with count_wire() as w:` "
                 "block): entering it again would restart its count and lose the outer one. Nest a second counter "
                 "instead: with count_wire() as inner: ...")
RESULTS = ("sent", "received", "store", "closed", "settled")


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """No test here may leave a default process group behind for the tests after it."""
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


# -- real sockets --------------------------------------------------------------------------------------------------

def _key(sock) -> str:
    """tcp_counters' key of a socket: its /proc/self/fd link, ``socket:[inode]``."""
    return f"socket:[{os.fstat(sock.fileno()).st_ino}]"


def _open_pair(host="127.0.0.1", family=socket.AF_INET) -> tuple:
    """A connected loopback TCP pair and its listener: (client, accepted end, listener); the caller closes them."""
    listener = socket.create_server((host, 0), family=family)
    try:
        client = socket.create_connection(listener.getsockname()[:2], timeout=10)
    except BaseException:
        listener.close()
        raise
    accepted, _ = listener.accept()
    accepted.settimeout(10)
    return client, accepted, listener


@contextlib.contextmanager
def _pair(host="127.0.0.1", family=socket.AF_INET):
    """:func:`_open_pair`, closed on leaving."""
    sockets = _open_pair(host, family)
    try:
        yield sockets
    finally:
        _close(sockets)


def _close(sockets) -> None:
    for s in sockets:
        s.close()


def _send(src, dst, n: int) -> None:
    """``n`` bytes from ``src``, all read at ``dst`` (so the kernel has counted them on both ends)."""
    src.sendall(b"w" * n)
    got = 0
    while got < n:
        chunk = dst.recv(n - got)
        assert chunk, "the peer closed"
        got += len(chunk)


def _closed_fds(n: int = 1) -> list:
    """The names of ``n`` file descriptor numbers this process does not have open."""
    names = []
    for fd in range(999_999, 0, -1):
        try:
            os.fstat(fd)
        except OSError:
            names.append(str(fd))
            if len(names) == n:
                return names
    raise AssertionError("every fd is open")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host, family", [
    ("127.0.0.1", socket.AF_INET),
    pytest.param("::1", socket.AF_INET6, marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no ::1 here")),
], ids=["ipv4", "ipv6"])
def test_tcp_counters_reads_what_the_kernel_carried_for_each_socket(host, family):
    with _pair(host, family) as (client, accepted, listener):
        _send(client, accepted, 3000)
        _send(accepted, client, 1234)
        counters = wire.tcp_counters()
        assert counters[_key(client)] == (3000, 1234)
        assert counters[_key(accepted)] == (1234, 3000)
        assert counters[_key(listener)] == (0, 0)          # a listening socket is a TCP socket that carried nothing
        _send(client, accepted, 100)
        assert wire.tcp_counters()[_key(client)] == (3100, 1234)   # counted since the socket opened
    for key, (sent, received) in counters.items():
        assert key.startswith("socket:[") and key.endswith("]"), key
        assert type(sent) is int and type(received) is int and sent >= 0 and received >= 0, (key, sent, received)


def test_tcp_counters_leaves_out_sockets_that_are_not_tcp():
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    unix_a, unix_b = socket.socketpair()
    try:
        udp.bind(("127.0.0.1", 0))
        with _pair() as (client, accepted, listener):
            counters = wire.tcp_counters()
            assert {_key(client), _key(accepted), _key(listener)} <= set(counters)
            assert not {_key(udp), _key(unix_a), _key(unix_b)} & set(counters)
    finally:
        for s in (udp, unix_a, unix_b):
            s.close()


# -- scripted file descriptors and TCP_INFO answers ----------------------------------------------------------------

class _Os:
    """wire's ``os`` with /proc/self/fd or /proc/self/task listed as a test says (and some fds' links given);
    everything else, the real ``os``."""

    def __init__(self, fds=None, links=None, tasks=None):
        self._fds, self._links, self._tasks = fds, links or {}, tasks

    def listdir(self, path):
        if path == "/proc/self/fd" and self._fds is not None:
            return list(self._fds)
        if path == "/proc/self/task" and self._tasks is not None:
            if isinstance(self._tasks, BaseException):
                raise self._tasks
            return list(self._tasks)
        return os.listdir(path)

    def readlink(self, path):
        if isinstance(path, str) and path.startswith("/proc/self/fd/") and path[14:] in self._links:
            return self._links[path[14:]]
        return os.readlink(path)

    def __getattr__(self, name):
        return getattr(os, name)


class _Answered:
    """A real socket (a duplicate, as wire makes) whose family, type or TCP_INFO answer a test gives."""

    def __init__(self, real, family=None, type=None, info=None):
        self._real, self._info = real, info
        self.family = real.family if family is None else family
        self.type = real.type if type is None else type

    def getsockopt(self, level, option, *buflen):
        if level == socket.IPPROTO_TCP and option == socket.TCP_INFO and self._info is not None:
            if isinstance(self._info, BaseException):
                raise self._info
            assert buflen and isinstance(buflen[0], int), buflen
            return self._info
        return self._real.getsockopt(level, option, *buflen)

    def close(self):
        self._real.close()


class _Sockets:
    """wire's ``socket`` module, where the sockets whose inode is in ``answers`` answer as given."""

    def __init__(self, answers):
        self._answers = answers

    def socket(self, *args, **kwargs):
        real = socket.socket(*args, **kwargs)
        answer = self._answers.get(os.fstat(real.fileno()).st_ino)
        return real if answer is None else _Answered(real, **answer)

    def __getattr__(self, name):
        return getattr(socket, name)


def _inode(sock) -> int:
    return os.fstat(sock.fileno()).st_ino


def _tcp_info(size=256, *, received, notsent, sent, retrans) -> bytes:
    """A ``struct tcp_info`` of ``size`` bytes: the four fields wire reads, every other byte nonzero."""
    info = bytearray((i % 251) + 1 for i in range(size))
    struct.pack_into("Q", info, 128, received)
    struct.pack_into("I", info, 144, notsent)
    struct.pack_into("Q", info, 200, sent)
    struct.pack_into("Q", info, 208, retrans)
    return bytes(info)


def test_tcp_counters_goes_past_every_fd_it_cannot_or_need_not_read(monkeypatch, tmp_path):
    """In this listing order each kind of fd wire skips comes before the TCP sockets it counts: a skip that stopped
    the listing instead would lose them."""
    dup_fails, gone = _closed_fds(2)
    with open(tmp_path / "a file", "wb") as a_file, _pair() as (client, accepted, listener), \
            _pair() as (refusing, _, _):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        unix_a, unix_b = socket.socketpair()
        try:
            _send(client, accepted, 700)
            _send(accepted, client, 70)
            fds = [gone,                          # closed while listed: no link
                   str(a_file.fileno()),          # not a socket
                   dup_fails,                     # a socket when its link was read, closed before the dup
                   str(unix_a.fileno()),          # a stream socket, not TCP
                   str(udp.fileno()),             # an IP socket, not a stream
                   str(unix_b.fileno()),          # not TCP, though it answers TCP_INFO (as an AF_SMC socket does)
                   str(refusing.fileno()),        # a TCP socket whose TCP_INFO fails
                   str(client.fileno()), str(accepted.fileno())]
            info = _tcp_info(received=5, notsent=0, sent=9, retrans=0)
            monkeypatch.setattr(wire, "os", _Os(fds=fds, links={dup_fails: "socket:[1]"}))
            monkeypatch.setattr(wire, "socket", _Sockets({
                _inode(unix_b): dict(info=info),
                _inode(refusing): dict(info=OSError(errno.EOPNOTSUPP, "no TCP_INFO here"))}))
            assert wire.tcp_counters() == {_key(client): (700, 70), _key(accepted): (70, 700)}
        finally:
            for s in (udp, unix_a, unix_b):
                s.close()


@pytest.mark.parametrize("fields, expected", [
    (dict(received=777, notsent=300, sent=5000, retrans=1200), (5000 - 1200 + 300, 777)),
    # the kernel's fields are unsigned (u64, u32): read past the sign bit they stay positive
    (dict(received=2**63 + 5, notsent=2**31 + 7, sent=2**63 + 1000, retrans=2**63 + 1), (999 + 2**31 + 7, 2**63 + 5)),
], ids=["retransmitted-and-queued", "unsigned"])
@pytest.mark.parametrize("size", [256, 216], ids=["full", "just-long-enough"])
def test_tcp_counters_reads_sent_minus_retransmitted_plus_queued_and_received(monkeypatch, fields, expected, size):
    with _pair() as (client, _, _):
        monkeypatch.setattr(wire, "os", _Os(fds=[str(client.fileno())]))
        monkeypatch.setattr(wire, "socket", _Sockets({_inode(client): dict(info=_tcp_info(size, **fields))}))
        assert wire.tcp_counters() == {_key(client): expected}


@pytest.mark.parametrize("size", [215, 100])
def test_tcp_counters_refuses_a_kernel_without_tcpi_bytes_sent(monkeypatch, size):
    with _pair() as (client, _, _):
        info = _tcp_info(received=1, notsent=1, sent=1, retrans=0)[:size]
        monkeypatch.setattr(wire, "os", _Os(fds=[str(client.fileno())]))
        monkeypatch.setattr(wire, "socket", _Sockets({_inode(client): dict(info=info)}))
        with pytest.raises(RuntimeError) as caught:
            wire.tcp_counters()
    assert str(caught.value) == (f"count_wire: this kernel's TCP_INFO has {size} bytes, without tcpi_bytes_sent "
                                 "(Linux >= 4.19 needed)")


def test_tcp_counters_refuses_a_process_without_a_tcp_socket(monkeypatch, tmp_path):
    unix_a, unix_b = socket.socketpair()
    try:
        with open(tmp_path / "f", "wb") as f:
            monkeypatch.setattr(wire, "os", _Os(fds=[str(f.fileno()), *_closed_fds(), str(unix_a.fileno())]))
            with pytest.raises(RuntimeError) as caught:
                wire.tcp_counters()
    finally:
        unix_a.close()
        unix_b.close()
    assert str(caught.value) == NO_TCP


# -- _other_threads_running ----------------------------------------------------------------------------------------

def _threads(monkeypatch, stats: dict, order=None) -> None:
    """/proc/self/task scripted: ``stats`` {thread id: its stat line}, where the id ``"me"`` is the caller's, listed
    in ``order`` (an id without a stat line is a thread that ended while listed)."""
    me = str(threading.get_native_id())
    real = {tid: (me if tid == "me" else tid) for tid in (order or list(stats))}
    files = {f"/proc/self/task/{real[tid]}/stat": line for tid, line in stats.items()}
    monkeypatch.setattr(wire, "os", _Os(tasks=list(real.values())))

    def scripted_open(path, *args, **kwargs):
        if path in files:
            mode = args[0] if args else kwargs.get("mode", "r")
            if mode != "rb":
                raise ValueError(f"the test's /proc opened with mode {mode!r}")
            return contextlib.nullcontext(types.SimpleNamespace(read=lambda: files[path]))
        return open(path, *args, **kwargs)     # anything else: the real file (an ended thread has none)

    monkeypatch.setattr(wire, "open", scripted_open, raising=False)


# "pid (comm) state ...": a comm may hold ") " and state letters itself
SLEEPING, RUNNING, DISK = b"4242 (gloo) S 1 2 3", b"4243 (ab) R 1 2 3", b"4244 (io) D 1 2 3"
TRICKY_SLEEPING = b"4245 (x) R) S 1 2 3"          # a thread named "x) R": the state is after the last ")"
GONE = _closed_fds()[0]                            # no /proc/self/task/<this>/stat


@pytest.mark.parametrize("stats, order, expected", [
    ({"me": RUNNING, "4101": TRICKY_SLEEPING, "4102": SLEEPING}, None, False),   # the caller runs: not counted
    ({"me": RUNNING, "4101": SLEEPING, "4102": RUNNING}, None, True),
    ({"me": RUNNING, "4101": SLEEPING, "4102": DISK}, None, True),
    ({"me": SLEEPING, "4102": RUNNING}, [GONE, "me", "4102"], True),              # a thread ended while listed
], ids=["others-asleep", "one-runs", "one-in-disk-wait", "one-ended"])
def test_other_threads_running_reads_each_other_threads_state(monkeypatch, stats, order, expected):
    _threads(monkeypatch, stats, order)
    assert wire._other_threads_running() is expected


def test_other_threads_running_is_true_when_the_threads_cannot_be_listed(monkeypatch):
    monkeypatch.setattr(wire, "os", _Os(tasks=PermissionError(errno.EACCES, "no /proc")))
    assert wire._other_threads_running() is True


def test_other_threads_running_sees_a_real_thread_working_outside_the_gil():
    stop, started = threading.Event(), threading.Event()
    data = bytes(4 << 20)

    def work():
        started.set()
        while not stop.is_set():
            hashlib.sha256(data).digest()       # hashes with the GIL released: running, not waiting

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        seen, deadline = False, time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            seen = wire._other_threads_running()
    finally:
        stop.set()
        thread.join(10)
    assert seen is True


# -- _store_bytes ----------------------------------------------------------------------------------------------------

def test_store_bytes_is_the_size_of_the_file_store_under_prefix_stores(monkeypatch, tmp_path):
    path = tmp_path / "store"
    file_store = dist.FileStore(str(path), 1)
    file_store.set("key", "value" * 20)
    nested = dist.PrefixStore("outer", dist.PrefixStore("inner", file_store))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: nested)
    assert wire._store_bytes() == os.path.getsize(path) > 100
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: file_store)
    assert wire._store_bytes() == os.path.getsize(path)


@pytest.mark.parametrize("make", [
    lambda: dist.HashStore(),                                          # no path: not a file
    lambda: dist.PrefixStore("p", dist.HashStore()),
    lambda: types.SimpleNamespace(path=None),
    lambda: types.SimpleNamespace(path=""),
    lambda: types.SimpleNamespace(path="/nonexistent/wire-test/store"),  # a file that is gone
], ids=["hash-store", "prefix-hash-store", "path-none", "path-empty", "path-gone"])
def test_store_bytes_is_zero_for_a_store_that_is_not_a_file(monkeypatch, make):
    store = make()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    assert wire._store_bytes() == 0


@pytest.mark.parametrize("error", [RuntimeError, ValueError, AttributeError])
def test_store_bytes_is_zero_without_a_default_store(monkeypatch, error):
    def no_store():
        raise error("no default group")

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", no_store)
    assert wire._store_bytes() == 0


def test_store_bytes_is_zero_without_a_process_group_or_torch_distributed(monkeypatch, tmp_path):
    assert wire._store_bytes() == 0                              # the real torch.distributed, no process group
    file_store = dist.FileStore(str(tmp_path / "store"), 1)
    file_store.set("key", "value")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: file_store)
    assert wire._store_bytes() > 0                               # the control
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert wire._store_bytes() == 0


# -- _require_rank ---------------------------------------------------------------------------------------------------

def test_require_rank_passes_in_a_rank(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert wire._require_rank() is None


def _refusal() -> str:
    with pytest.raises(RuntimeError) as caught:
        wire._require_rank()
    return str(caught.value)


def test_require_rank_refuses_a_process_that_is_not_a_rank(monkeypatch):
    assert _refusal() == NOT_A_RANK                               # torch.distributed, no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "is_available", lambda: False)
    assert _refusal() == NOT_A_RANK                               # a torch built without distributed
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert _refusal() == NOT_A_RANK                               # torch.distributed never imported


def test_count_wire_refuses_to_start_outside_a_rank():
    w = count_wire()
    with pytest.raises(RuntimeError) as caught, w:
        pass
    assert str(caught.value) == NOT_A_RANK
    with pytest.raises(RuntimeError) as caught:
        _ = w.sent
    assert str(caught.value) == NEVER_ENTERED                       # refused: nothing counted, not 0


# -- WireCount / count_wire arguments --------------------------------------------------------------------------------

def test_count_wire_defaults():
    for w in (count_wire(), WireCount()):
        assert (w.settle, w.max_wait) == (0.05, 5.0)
        assert type(w.settle) is float and type(w.max_wait) is float
    w = count_wire(1, 2)
    assert (w.settle, w.max_wait) == (1.0, 2.0) and type(w.settle) is float and type(w.max_wait) is float
    assert repr(count_wire()) == "WireCount(not counted: use `with count_wire() as w:`)"


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(settle=float("inf")), ValueError, "settle must be a finite number of seconds, got inf"),
    (dict(max_wait=float("nan")), ValueError, "max_wait must be a finite number of seconds, got nan"),
    (dict(max_wait=float("-inf")), ValueError, "max_wait must be a finite number of seconds, got -inf"),
    (dict(max_wait=float("inf")), ValueError, "max_wait must be a finite number of seconds, got inf (the count "
                                              "would wait forever for a socket that never goes quiet)"),
    (dict(settle=None), TypeError, "settle must be a number of seconds, got None"),
    (dict(settle=False), TypeError, "settle must be a number of seconds, got False"),
    (dict(settle=0.5, max_wait=0.25), ValueError, "need 0 <= settle <= max_wait, got settle=0.5, max_wait=0.25"),
], ids=["inf-settle", "nan-wait", "minus-inf-wait", "inf-wait", "none-settle", "bool-settle", "settle-past-wait"])
def test_count_wire_refuses_bad_settle_and_max_wait_word_for_word(kwargs, error, text):
    with pytest.raises(error) as caught:
        count_wire(**kwargs)
    assert str(caught.value) == "count_wire: " + text


def test_results_read_without_with_raise():
    w = count_wire()
    for name in RESULTS:
        with pytest.raises(RuntimeError) as caught:
            getattr(w, name)
        assert str(caught.value) == NEVER_ENTERED


# -- count_wire's re-reads, scripted ---------------------------------------------------------------------------------

class _Clock:
    """time.monotonic / time.sleep for wire: each sleep records its length and moves the clock ``step`` seconds."""

    def __init__(self, step: float):
        self.now, self.step, self.sleeps = 1024.0, step, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"sleep({seconds!r})")
        assert seconds >= 0 and len(self.sleeps) < 400, "count_wire kept re-reading"
        self.sleeps.append(seconds)
        self.now += self.step


def _at(i: int) -> dict:
    """The counters at the i-th read: one connection, 10 bytes sent and 3 received per step."""
    return {"socket:[1]": (1000 + 10 * i, 2000 + 3 * i)}


@pytest.fixture
def scripted(monkeypatch):
    """Install scripted counters for count_wire: ``reads`` (a list, the last repeating, or a function of the read's
    number from 0), whether other threads run, the store's sizes at enter and exit, and the clock's step."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)

    def install(reads, *, threads=False, store=(0, 0), step=0.25):
        state = types.SimpleNamespace(n=0, clock=_Clock(step))

        def counters():
            state.n += 1
            assert state.n <= 400, "count_wire kept re-reading"
            return dict(reads(state.n - 1) if callable(reads) else reads[min(state.n, len(reads)) - 1])

        sizes = iter(store)
        monkeypatch.setattr(wire, "tcp_counters", counters)
        monkeypatch.setattr(wire, "_other_threads_running", lambda: threads)
        monkeypatch.setattr(wire, "_store_bytes", lambda: next(sizes))
        monkeypatch.setattr(wire, "time", types.SimpleNamespace(monotonic=state.clock.monotonic,
                                                                sleep=state.clock.sleep))
        return state

    return install


def test_count_wire_subtracts_the_counters_at_the_start(scripted):
    before = {"socket:[a]": (100, 200), "socket:[b]": (40, 50)}
    after = {"socket:[a]": (150, 260), "socket:[c]": (7, 9)}     # b closed in the block, c opened in it
    state = scripted([before, after], store=(100, 130))
    with count_wire(settle=0) as w:
        for name in RESULTS:
            with pytest.raises(RuntimeError) as caught:
                getattr(w, name)
            assert str(caught.value) == READ_INSIDE
    assert (w.sent, w.received) == (50 + 7, 60 + 9)              # a connection opened inside counts from zero
    assert (w.store, w.closed, w.settled) == (30, 1, True)
    assert repr(w) == "WireCount(sent=57, received=69)"
    assert state.n == 2 and state.clock.sleeps == []             # settle=0: no re-read


def test_count_wire_settles_at_the_first_still_reread_after_late_bytes(scripted):
    """Bytes that reach the kernel after the block's last line are counted; a re-read that finds the counters
    unchanged while no other thread runs ends the count at once."""
    state = scripted([_at(0), _at(1), _at(2), _at(2), _at(3)], threads=False, step=2 ** -12)
    with count_wire() as w:
        pass
    assert (w.sent, w.received) == (20, 6)
    assert w.settled is True
    assert state.n == 4 and state.clock.sleeps == [0.0005, 0.0005]   # the pause starts again after a change


def test_count_wire_waits_settle_seconds_while_other_threads_run(scripted):
    """Unchanged counters while another thread runs: re-read after pauses of 0.5, 1, 2, 4, 5, 5 ... ms until they
    have not moved for ``settle`` seconds (here 8 re-reads of 1/16 s each), not one re-read more."""
    reads = [_at(0)] + [_at(1)] * 9 + [_at(2)]                  # read 11 would see late bytes
    state = scripted(reads, threads=True, step=0.0625)
    with count_wire(settle=0.5) as w:
        pass
    assert (w.sent, w.received) == (10, 3)
    assert w.settled is True
    assert state.clock.sleeps == [0.0005, 0.001, 0.002, 0.004, 0.005, 0.005, 0.005, 0.005]
    assert state.n == 10


def test_count_wire_stops_at_max_wait_unsettled(scripted):
    """Counters that move at every re-read: the count ends after ``max_wait`` seconds, with ``w.settled`` False."""
    state = scripted(_at, threads=True, step=0.25)
    with count_wire(settle=0.5, max_wait=1.0) as w:
        pass
    assert state.n == 6                                          # the read at entry and exit, then 4 re-reads
    assert (w.sent, w.received) == (50, 15)
    assert w.settled is False
    assert state.clock.sleeps == [0.0005] * 4


def test_count_wire_with_settle_zero_reads_once_at_exit(scripted):
    state = scripted([_at(0), _at(1), _at(2)], threads=True)
    with count_wire(settle=0, max_wait=0) as w:
        pass
    assert (w.sent, w.received, w.settled) == (10, 3, True)
    assert state.n == 2 and state.clock.sleeps == []


def test_count_wire_lets_an_error_in_the_block_through_and_still_counts(scripted):
    scripted([_at(0), _at(1)])
    w = count_wire(settle=0)
    with pytest.raises(KeyError, match="from the block"), w:
        raise KeyError("from the block")
    assert (w.sent, w.received, w.closed) == (10, 3, 0)


def test_count_wire_entered_again_is_refused_and_keeps_the_outer_count(scripted):
    state = scripted([_at(0), _at(5), _at(1)], store=(3, 8))
    with count_wire(settle=0) as w:
        with pytest.raises(RuntimeError) as caught:
            w.__enter__()
        assert str(caught.value) == ENTERED_AGAIN
    assert state.n == 2                                          # the refused entry read nothing
    assert (w.sent, w.received, w.store) == (50, 15, 5)


def test_count_wire_exited_without_entering_counts_from_zero(scripted):
    """``__exit__`` alone (e.g. an ExitStack unwinding a counter it never entered): every connection counts from
    zero and the store from an empty file."""
    scripted([_at(2)], store=(7,))
    w = count_wire(settle=0)
    assert w.__exit__(None, None, None) is False
    assert (w.sent, w.received, w.store, w.closed, w.settled) == (1020, 2006, 7, 0, True)


# -- count_wire on real sockets, in this process -------------------------------------------------------------------

def test_count_wire_counts_real_loopback_bytes_in_the_block(monkeypatch):
    """Only this test's sockets are counted (the counters of any other socket of the pytest process are left out),
    so the counts are exact: both ends of each pair are in this process, so each byte is sent once and received
    once."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)        # a rank, as far as count_wire can tell
    ours: set = set()
    real_counters = wire.tcp_counters
    monkeypatch.setattr(wire, "tcp_counters", lambda: {k: v for k, v in real_counters().items() if k in ours})
    with contextlib.ExitStack() as cleanup:
        kept, doomed = _open_pair(), _open_pair()
        cleanup.callback(_close, kept)
        cleanup.callback(_close, doomed)
        client, accepted, _ = kept
        ours.update(_key(s) for s in kept + doomed)
        _send(client, accepted, 500)                                 # before the block: not counted
        _send(doomed[0], doomed[1], 100)
        with count_wire() as w:
            _send(client, accepted, 300)
            _send(accepted, client, 40)
            _close(doomed)                                           # a connection closed inside the block
            with _pair() as (n_client, n_accepted, _):               # one opened and closed inside: unseen
                _send(n_client, n_accepted, 999)
            late = _open_pair()                                      # one opened inside: counted from zero
            cleanup.callback(_close, late)
            ours.update(_key(s) for s in late)
            _send(late[0], late[1], 64)
    assert (w.sent, w.received) == (300 + 40 + 64, 300 + 40 + 64)
    assert (w.store, w.closed, w.settled) == (0, 3, True)        # no process group: no store
    assert repr(w) == "WireCount(sent=404, received=404)"


@pytest.fixture
def gloo_rank(monkeypatch, tmp_path):
    """This process as rank 0 of a one-rank gloo group over a FileStore, destroyed when the test ends."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    path = tmp_path / "store"
    dist.init_process_group("gloo", store=dist.FileStore(str(path), 1), rank=0, world_size=1)
    try:
        yield path
    finally:
        dist.destroy_process_group()


def test_count_wire_in_a_real_one_rank_gloo_group_sees_the_file_store(gloo_rank):
    assert wire._require_rank() is None
    assert wire._store_bytes() == os.path.getsize(gloo_rank) > 0   # the default store: a PrefixStore on the file
    size = os.path.getsize(gloo_rank)
    with count_wire() as w:
        dist.all_reduce(torch.ones(4))                           # one rank: nothing on the wire
        dist.distributed_c10d._get_default_store().set("wire-test", b"x" * 100)
    assert w.store == os.path.getsize(gloo_rank) - size > 100
    assert w.closed == 0 and w.settled is True
    assert repr(w) == f"WireCount(sent={w.sent}, received={w.received})"
