"""Chapter 07's faults: each names the check cell that must catch it. (See ``labbook.faults``.)"""
from labbook.faults import Edit, Fault

SETUP, DDP_RUN, DDP_CHECK, CONTROLS = "1942cb84", "b7b09d31", "c4ec0762", "a05a927e"
REP_RUN, REP_CHECK = "46d64c40", "b8736f9e"
FSDP_IMPORT, FSDP_RUN, FSDP_CHECK, FSDP_CONTROL, FEATURES = "b22883c1", "da132827", "a4419baa", "9fd2f685", "d361d0d4"
MOE_IMPORT, MOE_RUN, MOE_PLOT, MOE_CHECK, EP_RUN, EP_CHECK, FMOE = (
    "32a5afe3", "eba2db80", "a22d1afa", "7a7031c0", "48c8f4c0", "6a334691", "d4db5262")
COST_RUN, COST_CHECK, VERDICT, RECORD, SPMD = "1f9abf3c", "adfaca94", "c16cc56e", "4831c003", "2b8edcde"

DDP_TOY, COSTS_TOY, MOE_TOY = "labbook/toys/ch07_ddp.py", "labbook/toys/ch07_costs.py", "labbook/toys/ch07_moe.py"
FSDP_TOY, DP = "labbook/toys/ch07_fsdp.py", "labutils/data_parallel.py"
REC = "benchmarks/results/data_parallel_costs_full.json"
DDP_CELLS, REP_CELLS = (SETUP, DDP_RUN, DDP_CHECK), (SETUP, DDP_RUN, REP_RUN, REP_CHECK)
FSDP_CELLS = (SETUP, FSDP_IMPORT, FSDP_RUN)
MOE_CELLS, COST_CELLS = (SETUP, MOE_IMPORT, MOE_RUN, MOE_PLOT, MOE_CHECK), (SETUP, COST_RUN, COST_CHECK)
RECORD_CELLS = (SETUP, COST_RUN, VERDICT, RECORD)

FAULTS = [
    # section 1: DDP against the local model
    Fault("batch_rows gives every rank one row too many (overlapping slices)", check=DDP_CHECK, expect="DDP, rank 0",
          library=(Edit(DDP_TOY, "slice(rank * n // world, (rank + 1) * n // world)",
                        "slice(rank * n // world, (rank + 1) * n // world + 1)"),), cells=DDP_CELLS),
    Fault("ddp_run trains the bare model: nothing averages the gradients", check=DDP_CHECK,
          expect="parameters == local model's",
          library=(Edit(DDP_TOY, "return train_side_by_side(lambda m: DDP(m), local_batch)\n",
                        "return train_side_by_side(lambda m: m, local_batch)\n"),), cells=DDP_CELLS),
    Fault("the slices check matches rows without using them up: a row received twice passes", check=CONTROLS,
          expect="whole batch on every rank",
          library=(Edit(DDP_TOY, "                unused.remove(hit)\n",
                        "                unused.remove(hit) if hit in unused else None\n"),
                   Edit(DDP_TOY, "hit = next((i for i in unused if torch.equal(batch[i], row)), None)",
                        "hit = next((i for i in range(batch.shape[0]) if torch.equal(batch[i], row)), None)")),
          cells=(SETUP, DDP_RUN, CONTROLS)),
    Fault("the 'no all-reduce' control wraps DDP after all, so it controls nothing", check=CONTROLS,
          expect="no all-reduce: the parity check fails",
          library=(Edit(DDP_TOY, '{"no all-reduce": train_side_by_side(lambda m: m, local_batch)',
                        '{"no all-reduce": train_side_by_side(lambda m: DDP(m), local_batch)'),),
          cells=(SETUP, DDP_RUN, CONTROLS)),
    # section 2: replicate()
    Fault("replicate_each_layer forgets fc3: its gradients are never averaged", check=REP_CHECK,
          expect="each layer replicated separately",
          library=(Edit(DDP_TOY, "    for layer in (model.fc1, model.fc2, model.fc3):\n        replicate(layer)",
                        "    for layer in (model.fc1, model.fc2):\n        replicate(layer)"),), cells=REP_CELLS),
    Fault("ignored_modules dropped: fc1's gradients are averaged too", check=REP_CHECK,
          expect="ignored_modules: fc1 grads differ",
          library=(Edit(DDP_TOY, "replicate(ign, ignored_modules=[ign.fc1])", "replicate(ign)"),), cells=REP_CELLS),
    # section 3: fully_shard
    Fault("the fully_shard side's optimizer loses its options but the learning rate", check=FSDP_CHECK,
          expect="fully_shard == DDP after 2 steps: SGD momentum",
          library=(Edit(FSDP_TOY, "opt_f = getattr(torch.optim, opt_name)(fsdp.parameters(), **opts)",
                        "opt_f = getattr(torch.optim, opt_name)(fsdp.parameters(), lr=opts['lr'])"),),
          cells=(*FSDP_CELLS, FSDP_CHECK)),
    Fault("the 'wrong mesh' control builds the whole world's mesh, so it controls nothing", check=FSDP_CONTROL,
          expect="fully_shard without the cross-rank reduction",
          library=(Edit(FSDP_TOY, 'return DeviceMesh.from_group(mine, "cpu")',
                        'return DeviceMesh.from_group(dist.group.WORLD, "cpu")'),), cells=(*FSDP_CELLS, FSDP_CONTROL)),
    Fault("the AVG feature row sums instead of averaging", check=FEATURES, expect="every feature row works",
          library=(Edit(FSDP_TOY, "dist.all_reduce(t, op=dist.ReduceOp.AVG)", "dist.all_reduce(t)"),),
          cells=(SETUP, DDP_RUN, REP_RUN, *FSDP_CELLS[1:], FEATURES)),
    # section 4: MoE under data parallelism
    Fault("the grouped reduction forgets DeepSpeed's division by the data-parallel size", check=MOE_CHECK,
          expect="grouped gradients == single-process reference",
          library=(Edit(DP, 'divisor = float(dist.get_world_size(dp_group)) if expert_scale == "mean" else 1.0',
                        "divisor = 1.0"),), cells=MOE_CELLS),
    Fault("replicate(ignored_modules=experts) leaves the expert gradients summed", check=MOE_CHECK,
          expect="replicate(ignored_modules=[experts])",
          library=(Edit(MOE_TOY, "p.grad /= world  # DeepSpeed's scale", "p.grad /= 1  # DeepSpeed's scale"),),
          cells=MOE_CELLS),
    Fault("the start-up broadcast leaves every expert alone, replicas or not", check=EP_CHECK,
          expect="the wrap's broadcast makes them equal",
          library=(Edit(DP, 'if params[key] and not (key == "expert" and expert_dp_group is None):',
                        'if params[key] and key != "expert":'),), cells=(SETUP, EP_RUN, EP_CHECK)),
    Fault("fastmoe's 'gate' tag is read as an expert tag: the gate is never averaged", check=FMOE,
          expect="the expert group carried",
          library=(Edit(DP, '"gate": "world", "world": "world"', '"gate": "expert", "world": "world"'),),
          cells=(*MOE_CELLS, FMOE)),
    # section 5: costs
    Fault("memory counts a DTensor whole, not this rank's shard", check=COST_CHECK,
          expect="fully_shard's shards over all ranks add up",
          library=(Edit(COSTS_TOY, 't = t.to_local() if hasattr(t, "to_local") else t',
                        't = t.full_tensor() if hasattr(t, "full_tensor") else t'),), cells=COST_CELLS),
    Fault("the in-step account counts each layer's weight, not its bias", check=COST_CHECK,
          expect="see their full parameters",
          library=(Edit(COSTS_TOY, "sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))",
                        "mod.weight.numel() * mod.weight.element_size()"),), cells=COST_CELLS),
    Fault("DDP's gradients are also averaged by hand: 2.2x the bytes", check=COST_CHECK, expect="W=2: DDP sent",
          library=(Edit(COSTS_TOY, "    return model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, after\n",
                        "    if mode == \"DDP\":\n        after = lambda: [dist.all_reduce(p.grad.div_(world)) "
                        "for p in model.parameters()]  # noqa: E731\n"
                        "    return model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, after\n"),),
          cells=COST_CELLS),
    Fault("the expert-parallel mode never reduces its gradients", check=COST_CHECK, expect="replicated parameters",
          library=(Edit(COSTS_TOY, "after = model.allreduce_gradients", "after = None"),), cells=COST_CELLS),
    Fault("the step timer measures nothing (t0 read after the step)", check=COST_CHECK,
          expect="the step timer measured the steps",
          library=(Edit(COSTS_TOY, "t0 = time.perf_counter()\n                    cost_step(*built[m])\n",
                        "cost_step(*built[m])\n                    t0 = time.perf_counter()\n"),), cells=COST_CELLS),
    Fault("the wire control's padding all-reduce is never sent", check=COST_CHECK,
          expect="negative control: an extra all-reduce",
          library=(Edit(COSTS_TOY, "dist.all_reduce(torch.zeros(pad))  # an extra", "torch.zeros(pad)  # an extra"),),
          cells=COST_CELLS),
    Fault("a stale record: DDP's recorded bytes from a run that sent 2.2x", check=RECORD, expect="it is not stale",
          library=(Edit(REC, '"DDP": 8160.0,', '"DDP": 17952.0,'),), cells=RECORD_CELLS),
    Fault("a stale record: fully_shard's recorded parameters unsharded", check=RECORD, expect="it is not stale",
          library=(Edit(REC, '"params": 3792,', '"params": 7584,'),), cells=RECORD_CELLS),
    # section 6: the end note
    Fault("the _spmd check imports a module that still exists", check=SPMD, expect="_spmd no longer exists",
          edits=(Edit(SPMD, "import torch.distributed._spmd  # noqa: F401", "import torch.distributed._composable"),),
          cells=(SETUP, SPMD)),
]
