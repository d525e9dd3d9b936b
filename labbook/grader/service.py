"""The grading service: a clean process (``python -I -m labbook.grader serve``) that imported torch and the grader,
built the identity bank, and forks one grading process per request, so that no request sees another's hidden
cases and a grading costs a fork, not an interpreter start. The student's kernel (feedback, ``grade``) and the
instructor's command (grades) talk to it the same way: a JSON line in (exercise, source), a JSON line out (the
report). (Part of the grader.)"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time

from labbook.grader.grading import Report

REQUEST_TIMEOUT_S = 600.0


def serve() -> None:
    """Answer requests from stdin until it closes (run by ``python -m labbook.grader serve``)."""
    import torch  # noqa: F401 - imported once, before any fork

    from labbook.grader import grading, identity

    identity.bank()
    out = sys.stdout
    sys.stdout = sys.stderr                                    # nothing but replies on the reply channel
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            reply = {"ok": True, "report": _fork_and_grade(grading, req)}
        except Exception as exc:  # noqa: BLE001 - a bad request is answered, not fatal
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def _fork_and_grade(grading, req: dict) -> dict:
    r, w = os.pipe()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            rep = grading.grade(req["exercise"], req["source"], req.get("seed"), req.get("n_hidden"),
                                req.get("case_timeout_s")).to_dict()
            data = json.dumps({"report": rep}).encode()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + REQUEST_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, 9)
                raise TimeoutError(f"grading took over {REQUEST_TIMEOUT_S:.0f} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    answer = json.loads(b"".join(chunks) or b'{"error": "the grading process died"}')
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer["report"]


class Service:
    """A client of one grading service process, started on first use and restarted if it died."""

    def __init__(self):
        self.proc = None

    def _start(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        self.proc = subprocess.Popen([sys.executable, "-I", "-m", "labbook.grader", "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     cwd=tempfile.gettempdir())

    def grade(self, exercise: str, source: str, seed=None, n_hidden=None, case_timeout_s=None,
              timeout: float = REQUEST_TIMEOUT_S + 60):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        req = {"exercise": exercise, "source": source, "seed": seed, "n_hidden": n_hidden,
               "case_timeout_s": case_timeout_s}
        proc.stdin.write((json.dumps(req) + "\n").encode())
        proc.stdin.flush()
        ready = select.select([proc.stdout], [], [], timeout)[0]
        line = proc.stdout.readline() if ready else b""
        if not line:
            self.close()
            raise RuntimeError("the grading service ended or did not answer; run the check again")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"the grader could not grade {exercise!r}: {reply['error']}")
        return Report(**reply["report"])

    def close(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.proc = None


_SERVICE = Service()
atexit.register(_SERVICE.close)


def grade(exercise: str, source: str, seed=None, n_hidden=None, case_timeout_s=None) -> Report:
    """Grade through this process's service (started on first use)."""
    return _SERVICE.grade(exercise, source, seed, n_hidden, case_timeout_s)
