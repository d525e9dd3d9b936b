"""Small models and worker functions the chapters show and the tests import. (Taught in chapters 02 and 07.)

A chapter prints them with ``labutils.show_source(obj)`` and runs them; the tests import the same code, so
there is one copy. A *worker* runs on every rank of ``labutils.launch(fn, world_size, ...)``: these are
module-level functions, which cloudpickle ships by reference (the worker imports their module). One module per
chapter section; every name is importable from ``labbook.toys``:

* ``ch02_deepspeed``: chapter 02, DeepSpeed's layer (imported inside the functions only): ``expert``,
  ``distinct_experts``; workers ``ep_parity`` (``ep_size=2`` vs ``ep_size=1``) and ``capacity_pitfall``;
* ``ch07_ddp``: chapter 07 sections 2-3, ``Net``, ``train_side_by_side``, workers ``ddp_run``,
  ``ddp_controls`` and ``replicate_checks``;
* ``ch07_fsdp``: section 4, ``SimpleMLP``, ``FSDP_CASES``, worker ``fsdp_vs_ddp``;
* ``ch07_moe``: section 5, ``Expert``, ``TinyMoE``, ``ep_copy``, worker ``moe_checks``;
* ``ch07_ep_groups``: section 5, workers ``moe_ep_groups`` and ``lab_fmoe_check``;
* ``ch07_costs``: section 6, worker ``dp_costs`` (memory, bytes on the wire, step time per choice).
"""
from labbook.toys.ch02_deepspeed import (  # noqa: F401
    capacity_pitfall,
    distinct_experts,
    ep_layers,
    ep_parity,
    expert,
)
from labbook.toys.ch07_costs import (  # noqa: F401
    COST_MODES,
    collective_bytes,
    cost_setup,
    cost_step,
    dp_costs,
    local_bytes,
    memory_per_rank,
    ring_minimum,
)
from labbook.toys.ch07_ddp import (  # noqa: F401
    ATOL,
    RTOL,
    Net,
    batch_rows,
    data_parallel_checks,
    ddp_controls,
    ddp_run,
    plain_params,
    replicate_checks,
    replicate_device_id_error,
    replicate_device_ids,
    replicate_each_layer,
    replicate_fsdp2,
    replicate_ignored_fc1,
    replicate_state_dicts,
    replicate_trains,
    slices_partition,
    step_model,
    train_side_by_side,
)
from labbook.toys.ch07_ep_groups import (  # noqa: F401
    broadcast_checks,
    fmoe_block,
    lab_fmoe_check,
    moe_ep_groups,
    replica_gap,
)
from labbook.toys.ch07_fsdp import (  # noqa: F401
    FSDP_CASES,
    BatchDim1,
    SimpleMLP,
    cpu_offload_error,
    fsdp_case,
    fsdp_vs_ddp,
    gloo_features,
    shard_each_linear,
    shard_table,
    solo_mesh,
    train_step,
)
from labbook.toys.ch07_moe import (  # noqa: F401
    Expert,
    TinyMoE,
    as_rank_names,
    ep_copy,
    grads_of,
    moe_checks,
    moe_grouped,
    moe_naive_ddp,
    moe_native,
    moe_setup,
    moe_train_parity,
    norm_rel,
)
