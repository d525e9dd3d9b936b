"""Small models and worker functions the chapters show and the tests import. (Taught in chapters 02 and 07.)

A chapter prints them with ``labutils.show_source(obj)`` and runs them; the tests import the same code, so
there is one copy. A *worker* runs on every rank of ``labutils.launch(fn, world_size, ...)``: these are
module-level functions, which cloudpickle ships by reference (the worker imports their module). One module per
chapter section, and each name has one address, its module's (``from labbook.toys.ch07_ddp import ddp_run``;
``labbook.toys.ddp_run``, the 0.3 hub's, warns until 1.0.0 through ``labutils._deprecate``):

* ``ch02_deepspeed``: chapter 02, DeepSpeed's layer (imported inside the functions only): ``expert``,
  ``distinct_experts``; workers ``ep_parity`` (``ep_size=2`` vs ``ep_size=1``) and ``capacity_pitfall``;
* ``ch07_ddp``: chapter 07 sections 2-3, ``Net``, ``train_side_by_side``, workers ``ddp_run``,
  ``ddp_controls`` and ``replicate_checks``;
* ``ch07_fsdp``: section 4, ``SimpleMLP``, ``FSDP_CASES``, worker ``fsdp_vs_ddp``;
* ``ch07_moe``: section 5, ``Expert``, ``TinyMoE``, ``ep_copy``, worker ``moe_checks``;
* ``ch07_ep_groups``: section 5, workers ``moe_ep_groups`` and ``lab_fmoe_check``;
* ``ch07_costs``: section 6, worker ``dp_costs`` (memory, bytes on the wire, step time per choice).
"""
from labutils._deprecate import forward_moved

forward_moved(__name__)
