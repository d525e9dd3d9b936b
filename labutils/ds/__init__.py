"""DeepSpeed in the lab (optional: only these features need the ``deepspeed`` package). (Chapter 02.)

* :mod:`labutils.ds.runtime`: import DeepSpeed quietly, start it in a notebook or in `launch` workers, build
  its CPU op once, guard against ranks that disagree on the capacity. Needs ``deepspeed`` when called.
* :mod:`labutils.ds.gating`: DeepSpeed's top-1/2/k gating re-derived in plain PyTorch. Needs only torch. Its
  capacity formula is the MoE core's (:func:`labutils.moe.capacity.deepspeed_capacity`; its old name
  ``ds.gating.ds_capacity`` warns until 1.0.0).
Importing this package sets no environment variable (:func:`import_deepspeed` does, when DeepSpeed starts).

A coursework copy that does not use DeepSpeed may delete this folder.
"""
from ..nbtools import quiet  # the wing's face names it too: DeepSpeed's logs are what it quiets most
from .runtime import (
                      CapacityMismatchError,
                      build_ops,
                      extensions_dir,
                      import_deepspeed,
                      init_deepspeed,
                      install_capacity_guard,
                      moe_layers,
                      shard_for_rank,
                      shm_op_built,
)

__all__ = ["import_deepspeed", "init_deepspeed", "quiet", "build_ops", "extensions_dir", "shm_op_built",
           "install_capacity_guard", "CapacityMismatchError", "moe_layers", "shard_for_rank"]
