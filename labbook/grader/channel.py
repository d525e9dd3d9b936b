"""Messages between the grading parent and its sandboxed children: length-prefixed ``torch.save`` frames over
pipes, read back with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples, dicts and
nothing else: an answer cannot carry code into the parent). (Part of the grader; see :mod:`labbook.grader`.)"""
from __future__ import annotations

import io
import os
import select
import struct
import time

import torch

MAX_BYTES = 256 * 2**20
_HEADER = struct.Struct("!Q")


class Timeout(Exception):
    """Nothing arrived within the time allowed."""


def send(fd: int, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = _HEADER.pack(len(buf.getbuffer())) + buf.getvalue()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    chunks, left = [], n
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise Timeout
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int, timeout: float):
    """The next message, or :class:`Timeout` / ``EOFError``; a message over ``MAX_BYTES`` is refused."""
    deadline = time.monotonic() + timeout
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if size > MAX_BYTES:
        raise ValueError(f"a message of {size} bytes (the limit is {MAX_BYTES})")
    return torch.load(io.BytesIO(_read_exactly(fd, size, deadline)), weights_only=True)
