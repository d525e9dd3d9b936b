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
bytes still queued), so it is complete when the block ends; ``received`` counts what has arrived so far,
and a peer's late message may land after the block. A connection closed inside the block is not counted.
"""
from __future__ import annotations

import os
import socket
import struct

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
    """The counter of :func:`count_wire`: ``sent`` and ``received`` bytes (ints), set when the block ends."""

    def __init__(self):
        self.sent = self.received = 0
        self._before: dict = {}

    def __enter__(self):
        self._before = tcp_counters()
        return self

    def __exit__(self, *exc):
        after = tcp_counters()
        zero = (0, 0)  # a connection opened inside the block counts from zero
        self.sent = sum(a[0] - self._before.get(k, zero)[0] for k, a in after.items())
        self.received = sum(a[1] - self._before.get(k, zero)[1] for k, a in after.items())
        return False

    def __repr__(self):
        return f"WireCount(sent={self.sent}, received={self.received})"


def count_wire() -> WireCount:
    """``with count_wire() as w: ...`` then ``w.sent`` / ``w.received``: TCP payload bytes this process's
    sockets carried during the block (see the module docstring for what is and is not seen)."""
    return WireCount()
