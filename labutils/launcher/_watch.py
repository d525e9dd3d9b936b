"""The collective watch: each rank publishes the ``torch.distributed`` collective it is in. Internal (chapter 00).

Each rank's collectives (all_reduce, all_gather, broadcast, barrier, ...; not send/recv) are wrapped to write
``(call number, inside?, start time, default group?, "name(shapes)")`` into the rank's 128-byte slot of the
shared file ``TMPDIR/calls.bin`` (a few microseconds a call); the parent reads every slot (:func:`read_calls`)
and reports ranks that sit in different collectives (``launcher``'s ``MISMATCH_S``). Imports nothing of its
package: the zygote loads this file by its path.
"""
from __future__ import annotations

import linecache
import mmap
import os
import struct

CALL_SLOT = struct.Struct("<qqdq96s")  # call number, inside (0/1), start (monotonic s), default group (0/1), text
SLOT_BYTES = 128

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


def watch_collectives(rank: int, cfg: dict) -> None:
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
