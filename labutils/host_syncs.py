"""Count the host reads of tensor values a block of code makes: what would stall a GPU. (Chapter 08; issue 40.)

    with count_host_syncs() as syncs:
        layer(x).sum().backward()
    assert syncs.total == 0, syncs.calls          # e.g. ['Tensor.tolist', 'aten.nonzero.default']

It works on the CPU, so a CPU-only test proves a layer's GPU path sync-free. Two views are needed, because on the
CPU some reads never reach PyTorch's dispatcher:

* a ``TorchDispatchMode`` sees the ops that read values on the host or size their output from them:
  ``aten._local_scalar_dense`` (what ``.item()``, ``int(t)``, ``bool(t)`` dispatch to), ``nonzero``,
  ``masked_select``, ``unique``, indexing with a bool mask, ``repeat_interleave`` without ``output_size`` and
  ``bincount`` (both read their input on CUDA to size the output), ``equal``;
* a ``TorchFunctionMode`` sees the Python methods that copy to the host: ``Tensor.tolist`` (which on a CPU tensor
  reads memory directly and dispatches nothing), ``.item``, ``.numpy``, ``.cpu``, ``.to("cpu")`` (a device
  named by a string).

Backward counts too: the autograd engine runs a CPU graph's backward on the calling thread, under both modes.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SYNCING_OPS = frozenset(str(op) for op in (
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.bincount.default,
    _aten.equal.default, _aten.is_nonzero.default))
HOST_METHODS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.item: "Tensor.item",
                torch.Tensor.numpy: "Tensor.numpy", torch.Tensor.cpu: "Tensor.cpu"}


def _is_host_copy(func, args, kwargs) -> bool:
    """``t.to("cpu")`` / ``t.to(device="cpu")``: a copy to the host written as such (on CUDA a sync). A device
    given as a ``torch.device`` is not counted: ``counts.to(x.device)`` follows ``x`` and is no copy on the GPU,
    but on the CPU, where this runs, the two cannot be told apart."""
    if func is not torch.Tensor.to:
        return False
    return any(isinstance(a, str) and torch.device(a).type == "cpu" for a in list(args[1:]) + list(kwargs.values()))


class _Ops(TorchDispatchMode):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        unsized = func in (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor) \
            and kwargs.get("output_size") is None                              # sizes its output from values
        if name in SYNCING_OPS or unsized:
            self.calls.append(name)
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()):
            self.calls.append(f"{name} (bool mask)")
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_METHODS:
            self.calls.append(HOST_METHODS[func])
        elif _is_host_copy(func, args, kwargs):
            self.calls.append("Tensor.to(cpu)")
        return func(*args, **kwargs)


class HostSyncs:
    """What :func:`count_host_syncs` saw: ``calls`` in order, ``total`` and ``counts`` (a Counter)."""

    def __init__(self):
        self.calls: list[str] = []

    @property
    def total(self) -> int:
        return len(self.calls)

    @property
    def counts(self) -> Counter:
        return Counter(self.calls)

    def __repr__(self) -> str:
        return f"HostSyncs(total={self.total}, {dict(self.counts)})"


class count_host_syncs:
    """Context manager: every host read of a tensor value inside the block (see the module's docstring)."""

    def __init__(self):
        self.syncs = HostSyncs()
        self._modes = (_Methods(self.syncs.calls), _Ops(self.syncs.calls))

    def __enter__(self) -> HostSyncs:
        for m in self._modes:
            m.__enter__()
        return self.syncs

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False
