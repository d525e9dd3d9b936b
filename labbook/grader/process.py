"""One sandboxed child as the grading parent sees it: forked before any case exists, fed cases over a pipe, its
output drained (and kept up to a limit), ended with SIGKILL. (Part of the grader.)"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

from labbook.grader import channel, sandbox

KEEP_OUTPUT = 64 * 1024


class Child:
    """A forked sandbox running ``entry``'s solution ``tree``; ``dist_init=(store, rank, world)`` for a rank."""

    def __init__(self, entry, tree, dist_init=None):
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        out_r, out_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: keep only its three pipe ends
            try:
                keep = sorted({to_r, from_w, out_w})
                for lo, hi in zip([3] + [k + 1 for k in keep], keep + [4096]):
                    os.closerange(lo, hi)
                os.close(0)
                sandbox.child_main(entry, tree, to_r, from_w, out_w, dist_init)
            finally:
                os._exit(0)
        for fd in (to_r, from_w, out_w):
            os.close(fd)
        self.pid, self.to, self.reply, self.out = pid, to_w, from_r, out_r
        self.output, self.printed, self.status = bytearray(), 0, None

    def _drain(self) -> None:
        while select.select([self.out], [], [], 0)[0]:
            chunk = os.read(self.out, 1 << 16)
            if not chunk:
                break
            self.printed += len(chunk)
            room = KEEP_OUTPUT - len(self.output)
            if room > 0:
                self.output += chunk[:room]

    def wait_reply(self, timeout: float):
        """The child's next message; raises ``channel.Timeout``, or ``EOFError`` when it died."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            left = deadline - time.monotonic()
            if left <= 0:
                raise channel.Timeout
            ready = select.select([self.reply, self.out], [], [], min(left, 0.5))[0]
            if self.reply in ready:
                try:
                    return channel.recv(self.reply, timeout=max(left, 1.0))
                finally:
                    self._drain()

    def ask(self, args, timeout: float):
        channel.send(self.to, {"kind": "case", "args": tuple(args)})
        return self.wait_reply(timeout)

    def died(self) -> str:
        """How the child ended, in words (after ``EOFError``)."""
        self.stop(kill=False)
        status = self.status or 0
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            return f"the process running your function died with signal {signal.Signals(sig).name}"
        return f"the process running your function exited (status {os.WEXITSTATUS(status)}) without answering"

    def stop(self, kill: bool = True) -> None:
        if self.status is not None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self._drain()
        _, self.status = os.waitpid(self.pid, 0)
        for fd in (self.to, self.reply, self.out):
            with contextlib.suppress(OSError):
                os.close(fd)

    def printed_lines(self, limit: int = 12) -> list:
        if not self.printed:
            return []
        text = self.output.decode(errors="replace").splitlines()
        shown = [f"    | {line[:160]}" for line in text[:limit]]
        more = "" if self.printed <= len(self.output) and len(text) <= limit else " (first lines)"
        return [f"your code printed {self.printed:,} characters{more}:"] + shown
