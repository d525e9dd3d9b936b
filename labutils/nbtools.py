"""Notebook conveniences: environment report, seeding, source display, silencing C-level output. (Chapter 00.)"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import platform
import random
import sys
import tempfile

import torch

from .optional import available


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def env_report(verbose: bool = True) -> dict:
    """Versions, cores and which backends exist here (gloo, NCCL, CUDA, DeepSpeed, fastmoe)."""
    import torch.distributed as dist

    from .presets import preset_name

    cuda = torch.cuda.is_available()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "fastmoe (fmoe)": "importable" if available("fmoe") else "not importable (needs CUDA; see README)",
        "matplotlib": _version("matplotlib"),
        "cloudpickle": _version("cloudpickle"),
        "cpu cores (usable)": len(os.sched_getaffinity(0)),
        "torch threads": torch.get_num_threads(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "cuda": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else "no",
        "preset": preset_name(),
    }
    if verbose:
        width = max(map(len, info))
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return info


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy (if present) and torch."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def show_source(obj) -> None:
    """Print the package's own source of ``obj``: chapters show the code they teach, never a copy."""
    path = inspect.getsourcefile(obj) or "?"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"# {os.path.relpath(path, root)}\n{inspect.getsource(obj).rstrip()}")


@contextlib.contextmanager
def quiet(keep_on_error: bool = True):
    """Swallow everything printed inside (Python prints and the C/C++ level: compilers, linkers, gloo).

    DeepSpeed prints unconditionally in a few places ("... built successfully", "No existing process group
    found, creating a new group ..."). If the block raises, the captured text is attached to the exception
    as a note so nothing useful is lost.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    python_level = io.StringIO()
    with tempfile.TemporaryFile() as c_level:
        saved = []
        try:
            for fd in (1, 2):
                try:
                    saved.append((fd, os.dup(fd)))
                    os.dup2(c_level.fileno(), fd)
                except OSError:  # no such fd (embedded interpreters): Python-level capture still applies
                    pass
            with contextlib.redirect_stdout(python_level), contextlib.redirect_stderr(python_level):
                yield
        except BaseException as exc:
            if keep_on_error:
                c_level.seek(0)
                text = (python_level.getvalue() + c_level.read().decode("utf-8", "replace")).strip()
                if text:
                    note = "output captured by labutils.nbtools.quiet():\n" + text[-4000:]
                    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
                    if add_note is not None:
                        add_note(note)
                    else:
                        print(note, file=sys.__stderr__ or sys.stderr)
            raise
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
