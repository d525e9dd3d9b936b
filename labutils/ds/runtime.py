"""Run the real DeepSpeed inside a notebook or `launch` workers, quietly. (Taught in chapter 02.)

    from . import init_deepspeed
    init_deepspeed()            # single process (gloo) in a notebook; adopts the group inside launch workers

* :func:`import_deepspeed` imports DeepSpeed with its CPU accelerator chosen explicitly (``DS_ACCELERATOR=cpu``
  without CUDA), its logger at ERROR and its C++ ops cached under ``<repo>/.cache/torch_extensions``
  (``TORCH_EXTENSIONS_DIR``, only when this package sits in the lab's repository); each variable only if unset
  and only when called (importing this module changes nothing). Every function here that needs DeepSpeed calls
  it; call it before a plain ``import deepspeed`` so that one is quiet too.
* :func:`init_deepspeed` starts ``deepspeed.comm``: with no process group it sets ``RANK=0 WORLD_SIZE=1
  LOCAL_RANK=0 MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` and starts gloo (no MPI); with an existing
  group (inside ``labutils.launch`` workers, torchrun) DeepSpeed adopts it. Calling it again does nothing.
* :func:`build_ops` builds DeepSpeed's shared-memory communication op once (``tools/build_ds_ops.py``), so
  no notebook or worker pays the ~30 s JIT build and no compiler output reaches a recorded cell.
* :func:`install_capacity_guard` turns DeepSpeed's all-to-all size mismatch (ranks that computed different
  expert capacities: a hang with NCCL, an abort with gloo) into a clear Python error, before the all-to-all.
"""
from __future__ import annotations

import logging
import os
import pathlib
import socket
import sys
import time

import torch

from .._deprecate import forward_moved
from ..nbtools import quiet  # its address: labutils.nbtools (and the wing's face, labutils.ds)

__all__ = ["import_deepspeed", "init_deepspeed", "build_ops", "extensions_dir", "shm_op_built",
           "install_capacity_guard", "CapacityMismatchError", "moe_layers", "shard_for_rank"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)

_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository, when the package sits in it
_OWN_ENV = False  # True once init_deepspeed has written the single-process rendezvous variables
_ADOPTED = None  # whether our DeepSpeed start found a torch.distributed group already running


def _in_lab_repo() -> bool:
    """This package sits in the lab's repository (not copied into someone else's project)."""
    return (_ROOT / "tools" / "build_ds_ops.py").is_file() and (_ROOT / "notebooks").is_dir()


def extensions_dir() -> pathlib.Path | None:
    """Where DeepSpeed's JIT-built C++ ops live: ``$TORCH_EXTENSIONS_DIR``, else the repo's ``.cache``.

    ``None`` means DeepSpeed's own default (``~/.cache/torch_extensions/py3X_cpu``) outside the lab repo.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return _ROOT / ".cache" / "torch_extensions" if _in_lab_repo() else None


def _prepare_environment() -> None:
    """DeepSpeed's op cache and CPU accelerator in ``os.environ`` (each only if unset): called by
    :func:`import_deepspeed`, never at import."""
    where = extensions_dir()
    if where is not None:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(where))
    if "deepspeed" not in sys.modules and not torch.cuda.is_available():
        # what DeepSpeed would pick anyway, without its "Setting accelerator to CPU" warning at import
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def import_deepspeed(quiet_logs: bool = True):
    """Import and return ``deepspeed`` (clear ImportError if missing); its logger is set to ERROR."""
    _prepare_environment()
    from ..optional import require

    deepspeed = require("deepspeed", "chapter 02 (DeepSpeed MoE)")
    if quiet_logs:
        ds_logger = logging.getLogger("DeepSpeed")
        ds_logger.setLevel(logging.ERROR)
        for handler in ds_logger.handlers:
            handler.setLevel(logging.ERROR)
    return deepspeed


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """Rendezvous variables for a one-process group; a fresh free port every time we own them."""
    global _OWN_ENV
    # torchrun-style variables of a multi-process job: respect them. A one-process group always gets a fresh
    # port: WORLD_SIZE=1 / MASTER_PORT inherited from a parent process (a test run, a kernel started from a
    # process that used DeepSpeed) may name a port that process still holds.
    launcher_env = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _OWN_ENV
    if launcher_env:
        os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    _OWN_ENV = True


def _adopted_env() -> None:
    """Inside an existing group DeepSpeed's engine still reads RANK/LOCAL_RANK/WORLD_SIZE from the env."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])


def init_deepspeed(backend: str = "gloo", verbose: bool = False) -> dict:
    """Start ``deepspeed.comm`` (idempotent); returns rank, world size, backend and whether it adopted a group.

    Without a process group: one process, ``backend`` (gloo), a free port, no MPI discovery. With one
    (``labutils.launch`` workers, torchrun): DeepSpeed adopts it and ``backend`` is ignored.
    """
    deepspeed = import_deepspeed()
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    global _ADOPTED
    if not ds_comm.is_initialized():
        adopted = _ADOPTED = dist.is_available() and dist.is_initialized()
        if adopted:
            _adopted_env()
        else:
            _single_process_env()
        t0 = time.perf_counter()
        with quiet():  # "DeepSpeed ... shm_comm_op built successfully" and, on a first build, the compiler
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        if verbose:
            print(f"deepspeed.comm started in {time.perf_counter() - t0:.1f} s")
    adopted = bool(_ADOPTED) if _ADOPTED is not None else True  # started by someone else: adopted
    info = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "adopted": adopted}
    if verbose:
        print(f"DeepSpeed {deepspeed.__version__}: rank {info['rank']} of {info['world_size']} "
              f"({info['backend']}{', adopted the existing group' if adopted else ''})")
    return info


# -- the shared-memory op ------------------------------------------------------------------------

def shm_op_built() -> bool:
    """True when DeepSpeed's ``deepspeed_shm_comm`` op is already compiled in :func:`extensions_dir`."""
    where = extensions_dir()
    if where is None:
        return False
    return any((where / "deepspeed_shm_comm").glob("deepspeed_shm_comm*.so"))


def build_ops(verbose: bool = True) -> dict:
    """Build (or load from the cache) the C++ op that ``deepspeed.init_distributed`` JIT-builds on CPU.

    Returns ``{"op", "seconds", "cached", "where"}``; ``op`` is None when DeepSpeed does not use it here
    (not Linux, a CUDA accelerator...). Compiler output goes to ``<where>/build_ds_ops.log``.
    """
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    where = extensions_dir()
    cached = shm_op_built()
    accelerator = get_accelerator()
    builder = accelerator.create_op_builder("ShareMemCommBuilder") if accelerator is not None else None
    result = {"op": None, "seconds": 0.0, "cached": cached, "where": str(where) if where else "default"}
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        if verbose:
            name = getattr(accelerator, "_name", accelerator)
            print(f"DeepSpeed uses no shared-memory op on accelerator {name!r}: nothing to build")
        return result
    t0 = time.perf_counter()
    try:
        with quiet():
            builder.load(verbose=False)
    finally:
        result.update(op=builder.NAME, seconds=time.perf_counter() - t0)
    if verbose:
        how = "already cached" if cached else "built"
        print(f"{builder.NAME}: {how} in {result['seconds']:.1f} s under {result['where']}")
    return result


# -- capacity agreement guard ------------------------------------------------------------------

class CapacityMismatchError(RuntimeError):
    """Expert-parallel ranks computed different expert capacities: DeepSpeed's all-to-all would hang."""


def moe_layers(model: torch.nn.Module) -> list:
    """Every ``deepspeed.moe.layer.MoE`` in ``model`` (in module order)."""
    import_deepspeed()
    from deepspeed.moe.layer import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_for_rank(full: dict, sharded_model: torch.nn.Module, rank: int) -> dict:
    """Map ``name -> tensor`` of an ``ep_size=1`` model onto the names of the same model built with
    ``ep_size > 1``, as seen on ``rank``. (Chapter 02.)

    With ``ep_size = P`` each rank holds ``E / P`` experts: local expert ``j`` on ``rank`` is global expert
    ``rank * (E / P) + j`` (DeepSpeed's all-to-all sends expert block ``r`` of the ``(E, C, d)`` buffer to
    rank ``r``). Works for parameters, gradients or a state_dict:
    ``sharded.load_state_dict(shard_for_rank(full.state_dict(), sharded, rank))``.
    """
    import_deepspeed()
    from deepspeed.moe.layer import MoE

    mapping = {}
    for prefix, module in sharded_model.named_modules():
        if isinstance(module, MoE):
            head = (prefix + "." if prefix else "") + "deepspeed_moe.experts.deepspeed_experts."
            mapping[head] = module.num_local_experts
    out = {}
    for name in sharded_model.state_dict():
        source = name
        for head, local in mapping.items():
            if name.startswith(head):
                j, rest = name[len(head):].split(".", 1)
                source = f"{head}{rank * local + int(j)}.{rest}"
        if source in full:
            out[name] = full[source]
    return out


def _capacity_of(output) -> int:
    # sparse routes (what MOELayer asks for): (l_aux, capacity, E, indices, locations, gates, exp_counts)
    if len(output) == 7:
        return int(output[1])
    return int(output[1].shape[-1])  # dense: (l_aux, combine_weights (S, E, C), dispatch_mask, exp_counts)


def install_capacity_guard(model: torch.nn.Module) -> list:
    """Check, before every expert-parallel all-to-all, that all ranks agree on the capacity. (Chapter 02.)

    DeepSpeed sizes its all-to-all buffers ``(E, C, d)`` from each rank's own capacity ``C``. When ranks
    disagree (``drop_tokens=False`` without the expert group's MAX all-reduce, or different batch sizes per
    rank) the all-to-all hangs with NCCL and aborts the process with gloo. The guard all-gathers ``C``
    (one int per rank) after each gate and raises :class:`CapacityMismatchError` on every rank instead.
    Returns the hook handles (``h.remove()`` to uninstall). Layers with ``ep_size == 1`` are skipped.
    """
    from ..agreement import gather_rows

    handles = []
    for index, layer in enumerate(moe_layers(model)):
        if layer.ep_size == 1:
            continue
        moe = layer.deepspeed_moe

        def check(gate, inputs, output, index=index, moe=moe):
            group = moe.ep_group  # None: MOELayer's all-to-all then runs over the whole world
            rows = gather_rows([_capacity_of(output), inputs[0].shape[0]], inputs[0], group,  # (world, 2)
                               check_length=False)
            caps, tokens = rows[:, 0].tolist(), rows[:, 1].tolist()
            if len(set(caps)) > 1:
                raise CapacityMismatchError(
                    f"MoE layer {index}: expert-parallel ranks disagree on the expert capacity {caps} "
                    f"(tokens per rank {tokens}); DeepSpeed's all-to-all would hang (NCCL) or abort (gloo). "
                    "Fix: let DeepSpeed create the expert groups (deepspeed.initialize, or "
                    "layer.set_deepspeed_parallelism()) so drop_tokens=False agrees on max capacity, and give "
                    "every rank the same number of tokens.")

        handles.append(moe.gate.register_forward_hook(check))
    return handles
