"""Why a checkpoint could not be written or read, in words: the path, the cause and what to do (a full disk, a
directory that is not writable, a truncated file, a bare ``state_dict``, a pickle that would run code). Used by
:mod:`labutils.checkpoint` (taught in chapter 03); never the advice to disable ``weights_only``."""
from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import zipfile

import torch

# torch's own words when its writer could not write all the bytes (it gives no errno)
TORCH_WRITE_FAILED = ("unexpected pos", "iostream error", "file write failed", "failed writing")


def save_failure(path: str, exc: BaseException):
    """A clear ``OSError`` for a save of ``path`` that failed with ``exc`` (the tmp file already removed), or
    None to re-raise ``exc`` as it is."""
    folder = os.path.dirname(os.path.abspath(path))
    kept = (f"the previous checkpoint {path!r} is unchanged" if os.path.exists(path) else f"{path!r} was not created")
    kept += f" and no {os.path.basename(path)}.tmp is left"
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or (
            isinstance(exc, RuntimeError) and ("Permission denied" in text or "Read-only file system" in text)):
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else text
        return PermissionError(errno.EACCES if code is None else code,
                               f"cannot write checkpoint {path!r}: the directory {folder!r} is not writable "
                               f"({why}); {kept}. Save to a directory you can write to")
    if code == errno.ENOENT and not os.path.isdir(folder):
        return FileNotFoundError(errno.ENOENT, f"cannot write checkpoint {path!r}: the directory {folder!r} does "
                                 f"not exist; create it first (os.makedirs({folder!r}, exist_ok=True))")
    full = code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    if full or (isinstance(exc, RuntimeError) and any(w in text for w in TORCH_WRITE_FAILED)):
        how = (f"{exc.strerror or text}" if isinstance(exc, OSError) else
               f"torch's writer stopped part-way: {text.strip()!r}, which is how torch reports a full disk or quota")
        try:
            free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free there now"
        except OSError:
            free = "free space unknown"
        return OSError(errno.ENOSPC, f"no space left on the device holding {folder!r}: writing checkpoint {path!r} "
                       f"failed ({how}); {kept} ({free}). Free some space or save the checkpoint elsewhere")
    return None


def load_failure(path: str, exc: Exception) -> str:
    """What went wrong reading ``path``, in words (never the advice to disable ``weights_only``)."""
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (0 bytes): a save or a copy that was interrupted"
    if isinstance(exc, pickle.UnpicklingError):
        return (f"{size} bytes that are not tensors and plain containers ({refused_global(str(exc))}); labutils "
                "only loads checkpoints that cannot run code, so this file was not written by labutils.train")
    cut = truncated(path, exc)
    if cut:
        return f"{size} bytes: the file is truncated ({cut}): a save or a copy was cut short; copy or " \
               "write it again"
    if isinstance(exc, RuntimeError) and "zip archive" in str(exc):
        return f"{size} bytes that are not a complete torch.save archive: the file is truncated or corrupted"
    return f"{size} bytes that torch.load cannot read ({type(exc).__name__}: {exc}): not a torch.save file"


def truncated(path: str, exc: Exception) -> str:
    """How ``path`` shows it is the first part of a torch.save file, in words ("" when it does not): a zip
    archive (torch.save's format) whose end, the central directory, is missing, or an unexpected end of file."""
    with open(path, "rb") as f:
        zip_start = f.read(4) == b"PK\x03\x04"
    if zip_start and not zipfile.is_zipfile(path):
        return "it starts as a torch.save zip archive, but the zip's central directory at its end is missing"
    if isinstance(exc, EOFError) or "unexpected EOF" in str(exc):
        return "unexpected end of file"
    return ""


def what_dict(state: dict) -> str:
    """Why a dict without a ``version`` is not a checkpoint, and what to do with it."""
    keys = list(state)
    if keys and all(isinstance(k, str) for k in keys) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return (f"a bare state_dict ({len(keys)} tensors, e.g. {keys[0]!r}), not a checkpoint written by "
                "save_checkpoint or train(checkpoint=...): it holds weights only, no optimizer, step or RNG state "
                "to resume from. Load it with model.load_state_dict(torch.load(path, weights_only=True))")
    if set(keys) == {"state", "param_groups"}:
        return ("a bare optimizer state_dict, not a checkpoint written by save_checkpoint or "
                "train(checkpoint=...). Load it with optimizer.load_state_dict(torch.load(path, weights_only=True))")
    return (f"not a labutils checkpoint: a dict without a 'version' key (keys {keys[:8]}"
            f"{' ...' if len(keys) > 8 else ''}); checkpoints are written by save_checkpoint or train(checkpoint=...)")


def refused_global(message: str) -> str:
    """What torch's weights-only unpickler refused, from its message: the global (a function or class the file
    would call or build, e.g. ``posix.system``) when it names one, else its own first line, without torch's advice
    to lift the restriction."""
    name = re.search(r"GLOBAL ([\w.]+)", message)
    if name:
        return f"it refers to the global {name.group(1)}, which loading would import and call"
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))
                   and "weights_only" not in ln), None)
    return reason.split(". Please use")[0] if reason else "a pickle the weights-only loader refuses"
