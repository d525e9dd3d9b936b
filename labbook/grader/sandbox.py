"""The sandboxed child: it loads one solution's source and answers the cases the parent sends, under an audit
hook (PEP 578) that nothing in the child can remove. (Part of the grader; see :mod:`labbook.grader`.)

The hook refuses, for the whole life of the child: imports the solution asks for outside the exercise's list
(torch's own lazy imports pass; their files are checked), compiling or running code the solution asks for, running
code from the book's packages, DeepSpeed or fastmoe, building code objects, processes, signals, sockets,
``ctypes``, profile and trace hooks, ``gc``'s object walks, new audit hooks, and opening any file other than a read
of Python's or an installed package's own files. Python 3.11 audits no thread start, so the child's thread
starters are replaced by a refusal before the hook goes in. The solution runs with builtins that lack
``exec``, ``eval``, ``compile``, ``open``, ``getattr`` and friends, and an ``__import__`` that enforces the list.
"""
from __future__ import annotations

import builtins
import os
import resource
import sys
import sysconfig

import torch

from labbook.grader import adapters, channel

REFUSED = frozenset({"_thread.start_new_thread", "sys.setprofile", "sys.settrace", "sys._current_frames",
                     "sys._current_exceptions", "sys.addaudithook", "sys.setrecursionlimit", "gc.get_objects",
                     "gc.get_referrers", "gc.get_referents", "gc.freeze", "code.__new__", "function.__new__",
                     "subprocess.Popen", "pty.spawn", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                     "os.exec", "os.system", "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "os.chdir",
                     "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
                     "os.chmod", "os.chown", "os.utime", "os.setxattr", "os.removexattr", "os.startfile",
                     "resource.setrlimit", "resource.prlimit", "sys.monitoring.register_callback",
                     "cpython.run_command", "cpython.run_file", "cpython.run_module", "cpython.run_stdin"})
REFUSED_PREFIXES = ("ctypes.", "socket.", "signal.", "shutil.", "webbrowser.", "urllib.", "http.", "ftplib.",
                    "smtplib.", "winreg.", "_winapi.", "mmap.")
HIDDEN_BUILTINS = frozenset({"exec", "eval", "compile", "open", "getattr", "setattr", "delattr", "globals",
                             "locals", "vars", "breakpoint", "input", "help", "memoryview", "exit", "quit",
                             "copyright", "credits", "license", "__loader__", "__spec__"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _roots() -> tuple:
    """``(readable, denied)`` directory prefixes: Python's own library and installed packages may be read (and
    their modules run, when torch imports them lazily); the book's checkout and packages, DeepSpeed and fastmoe may
    not."""
    from labbook.grader import identity

    paths = sysconfig.get_paths()
    readable = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"],
                os.path.dirname(torch.__file__)}
    denied = {str(identity.ROOT / sub) for sub in ("labutils", "labbook", "notebooks", "tests", "tools", "benchmarks",
                                                   "build")}
    for pkg in ("labutils", "labbook", "deepspeed", "fmoe", "fmoe_cuda"):
        where = identity._package_dir(pkg)
        if where is not None:
            denied.add(str(where))
    return (tuple(os.path.realpath(r) + os.sep for r in readable),
            tuple(os.path.realpath(d) + os.sep for d in denied))


def _under(path, roots: tuple) -> bool:
    return isinstance(path, str) and os.path.realpath(path).startswith(roots)


_IMPORTLIB = os.path.dirname(os.path.realpath(__import__("importlib").__file__)) + os.sep


def _asked_by_solution(depth: int = 3, through_importlib: bool = True) -> bool:
    """Whether the solution itself asked for what the hook sees: the first frame ``depth`` up (past this function,
    the hook's ``judge`` and ``hook``; then past importlib's frames when ``through_importlib``) is the solution's."""
    frame = sys._getframe(depth)
    while through_importlib and frame is not None and (
            frame.f_code.co_filename.startswith("<frozen importlib")
            or os.path.realpath(frame.f_code.co_filename).startswith(_IMPORTLIB)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == "<solution>"


def install_hook(policy, student_code) -> None:
    """Install the child's audit hook (irrevocable: Python has no way to remove one)."""
    readable, denied = _roots()
    state = {"student_exec": False, "busy": False}

    def hook(event, args):
        if state["busy"]:       # the hook's own frame reads (f_code, sys._getframe) raise events too
            return
        state["busy"] = True
        try:
            judge(event, args)
        finally:
            state["busy"] = False

    def judge(event, args):
        if event == "exec":
            code = args[0]
            if code is student_code and not state["student_exec"]:
                state["student_exec"] = True
                return
            where = getattr(code, "co_filename", "")
            if not _asked_by_solution() and (   # whoever asked, past importlib (import_module has no event)
                    where == "<string>" or (_under(where, readable) and not _under(where, denied))):
                return          # modules torch imports lazily, and the named tuples they generate
            raise PermissionError(f"grader policy: running code from {where or code!r} is not allowed")
        if event == "compile":
            if _asked_by_solution(through_importlib=False):
                raise PermissionError("grader policy: compiling code at run time is not allowed")
            return
        if event == "import":
            name = args[0]
            if policy.allowed_module(name) or not _asked_by_solution():
                return          # torch's own lazy imports (sympy, ...) pass; their files are checked at exec
            raise ImportError(f"grader policy: `import {name}` is not allowed in this exercise")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            if not writes and _under(path, readable) and not _under(path, denied):
                return
            raise PermissionError(f"grader policy: opening {path!r} is not allowed")
        if event == "object.__getattr__" and _asked_by_solution(through_importlib=False):
            raise PermissionError(f"grader policy: reading .{args[1]} is not allowed")  # __code__, gi_frame, ...
        if event in REFUSED or event.startswith(REFUSED_PREFIXES):
            raise PermissionError(f"grader policy: {event} is not allowed")

    sys.addaudithook(hook)


def _close_thread_door() -> None:
    """Python 3.11 raises no audit event when a thread starts: the child's only ways to start one from Python are
    replaced by a refusal (the originals are unreachable from the solution: no reflection, no ``gc``)."""
    import _thread
    import threading

    def refused(*args, **kwargs):
        raise PermissionError("grader policy: starting a thread is not allowed")

    for module, names in ((_thread, ("start_new_thread", "start_new", "start_joinable_thread")),
                          (threading, ("_start_new_thread", "_start_joinable_thread"))):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, refused)


def namespace(policy) -> dict:
    """The solution's globals: the exercise's provided modules and builtins without the dynamic ones."""
    import importlib

    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level or not policy.allowed_module(name):
            raise ImportError(f"grader policy: `import {name}` is not allowed in this exercise")
        return real_import(name, globals, locals, fromlist, level)

    safe = {k: v for k, v in vars(builtins).items() if k not in HIDDEN_BUILTINS}
    safe["__import__"] = guarded_import
    ns = {"__name__": "solution", "__builtins__": safe}
    for alias, module in policy.provided:
        ns[alias] = importlib.import_module(module)
    return ns


def _warm_up() -> None:
    """Imports the child needs later (message framing, tracebacks), before the hook closes the door."""
    import io
    import traceback  # noqa: F401

    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1), "t": (1, 2.0, None, "s", True)}, buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def child_main(entry, tree, rfd: int, wfd: int, outfd: int, dist_init=None) -> None:
    """The child's whole life (never returns): set up, load the solution, answer cases until told to stop."""
    try:
        os.dup2(outfd, 1)
        os.dup2(outfd, 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        torch.set_num_threads(1)
        if dist_init is not None:
            import torch.distributed as dist

            store_path, rank, world = dist_init
            store = dist.FileStore(store_path, world)  # pyright: ignore[reportPrivateImportUsage]
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        _warm_up()
        code = compile(tree, "<solution>", "exec")
        ns = namespace(entry.policy)
        _close_thread_door()
        install_hook(entry.policy, code)
        try:
            exec(code, ns)
        except BaseException as exc:  # noqa: BLE001 - loading the student's cell may raise anything
            channel.send(wfd, {"kind": "load-error", "type": type(exc).__name__, "message": str(exc)[:400],
                               "line": adapters.solution_line(exc)})
            return
        fn = ns.get(entry.function)
        if not callable(fn):
            channel.send(wfd, {"kind": "load-error", "type": "NameError",
                               "message": f"`{entry.function}` is not a function after running the cell",
                               "line": None})
            return
        channel.send(wfd, {"kind": "ready"})
        while True:
            try:
                msg = channel.recv(rfd, timeout=3600.0)
            except (EOFError, channel.Timeout):
                return
            if msg.get("kind") != "case":
                return
            sys.stdout.flush()
            channel.send(wfd, adapters.run(entry.adapter, fn, tuple(msg["args"])))
    except BaseException:  # noqa: BLE001 - the grader's own failure: said on the child's output, then exit 70
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
