"""The GPU path's one rule: no host synchronisation inside the layer. (Taught in chapter 08; issue 40.)

On a GPU, any read of a tensor's value by the host (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``,
``nonzero``, boolean indexing, and ``torch.bincount``, which reads the largest id) waits until every kernel
queued before it has run. The lab's layers check their inputs and count tokens with such reads on the CPU, where
they cost nothing. Inside ``with device_path():`` (entered by :class:`~labutils.moe.layers.FMoE` and
:class:`~labutils.moe.modern.layer.ModernMoE` when their expert backend is ``"grouped"``, see
:func:`labutils.moe.dispatch.pick_backend`) the same code runs without them:

* :func:`require` checks with ``torch._assert_async``: a failed check still stops the run, on the CPU at once
  and on CUDA at the next synchronisation (a device-side assert), with a shorter message (the host-side one
  names the offending tokens, which needs their values on the host);
* :func:`bincount` counts with a scatter-add into a fixed ``(n,)`` tensor.

:func:`labutils.host_syncs.count_host_syncs` is how a test sees that no host read happened.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Callable

import torch

_ON = contextvars.ContextVar("labutils_device_path", default=False)


@contextmanager
def device_path(on: bool = True):
    """Run the block on the device path (``on=True``) or the host path (``on=False``); nests and restores."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def on_device_path() -> bool:
    """Whether the code running now must not read tensor values on the host."""
    return _ON.get()


def device_check(ok: torch.Tensor, error: Callable[[], Exception], device_message: str) -> None:
    """Raise ``error()`` unless every element of the bool tensor ``ok`` is true.

    On the device path the check is ``torch._assert_async(ok.all(), device_message)`` instead: no host read,
    and a failure still stops the run (``RuntimeError`` naming ``device_message`` on the CPU; a device-side
    assert on CUDA)."""
    if on_device_path():
        torch._assert_async(ok.all(), device_message)  # pyright: ignore[reportPrivateImportUsage]
    elif not bool(ok.all()):
        raise error()


def bincount(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``(n,)`` int64 counts of ``ids`` (each in ``0..n-1``). Host path: ``torch.bincount``; device path: a
    scatter-add, which needs no host read (CUDA's ``bincount`` reads ``ids.max()`` to size its output)."""
    if on_device_path():
        return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.reshape(-1),
                                                                                  torch.ones_like(ids.reshape(-1)))
    return torch.bincount(ids.reshape(-1), minlength=n)[:n]
