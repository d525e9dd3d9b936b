"""Chapter 07, section 6: what each data-parallel choice costs per rank: memory, bytes on the wire, step time.
(Taught in chapter 07.)

Worker ``dp_costs`` builds every mode of ``COST_MODES`` once and times them in rotated rounds; bytes come from
``labutils.wire`` (the kernel's TCP counters), next to a ring algorithm's minimum (``collective_bytes``).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labbook.toys.ch07_ddp import replicate_fsdp2
from labbook.toys.ch07_ep_groups import replica_gap
from labbook.toys.ch07_fsdp import SimpleMLP, shard_each_linear
from labbook.toys.ch07_moe import TinyMoE, ep_copy
from labutils.data_parallel import GroupedDataParallel, is_expert_param

COST_MODES = ("DDP", "replicate", "replicate (FSDP2)", "fully_shard", "MoE, experts replicated (DDP)",
              "MoE, expert parallel (grouped)")


def local_bytes(t):
    """Bytes this rank holds for ``t`` (a ``DTensor``: its local shard only; None: 0)."""
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def memory_per_rank(model, opt):
    """Bytes of parameters, gradients and Adam's state (moments; step counters) this rank holds, counted tensor by
    tensor. DDP's gradient buckets (a second gradient-sized buffer unless ``gradient_as_bucket_view=True``) and
    activations are not counted."""
    state = [(k, v) for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v)]
    return {"params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in model.parameters()),
            "adam moments": sum(local_bytes(v) for k, v in state if k in ("exp_avg", "exp_avg_sq")),
            "adam steps": sum(local_bytes(v) for k, v in state if k == "step")}


def cost_setup(mode, d, h, rows, tokens):
    """(model, optimizer, batch, after_backward) for one mode of COST_MODES; the same seed on every rank."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    after = None
    if mode.startswith("MoE"):
        moe = TinyMoE(d, h, num_experts=world)
        if mode == "MoE, experts replicated (DDP)":
            model = DDP(moe)
        else:
            model = GroupedDataParallel(ep_copy(moe, rank, dist.group.WORLD))
            after = model.allreduce_gradients
        torch.manual_seed(10 + rank)
        batch = (torch.randn(tokens, d), torch.randn(tokens, d))  # (T, d) each
    else:
        mlp = SimpleMLP()
        model = {"DDP": lambda: DDP(mlp), "replicate": lambda: replicate(mlp),
                 "replicate (FSDP2)": lambda: replicate_fsdp2(mlp),
                 "fully_shard": lambda: shard_each_linear(mlp, init_device_mesh("cpu", (world,)))}[mode]()
        torch.manual_seed(10 + rank)
        batch = (torch.randn(rows, 50), torch.randn(rows, 8))  # (B, 50), (B, 8)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, after


def cost_step(model, opt, batch, after):
    """One training step: forward, mean-squared error, backward, the grouped reduction if any, Adam."""
    opt.zero_grad(set_to_none=False)
    F.mse_loss(model(batch[0]), batch[1]).backward()
    if after is not None:
        after()
    opt.step()


def ring_minimum(mode, memory, world):
    """Bytes a rank must send per step for the dense modes with ring collectives (None for the MoE modes): an
    all-reduce sends 2(W-1)/W of the gradient, an all-gather or reduce-scatter (W-1)/W of the whole parameter;
    fully_shard all-gathers in forward and again in backward (resharded after forward), then reduce-scatters."""
    if mode.startswith("MoE"):
        return None
    full = memory["params"] * (world if mode == "fully_shard" else 1)
    return (3 if mode == "fully_shard" else 2) * (world - 1) * full / world


def replicated_params(mode, model):
    """The parameters ``mode`` keeps equal on every rank (local tensors): every one, except fully_shard's shards
    (none) and the expert-parallel mode's experts (each rank its own)."""
    if mode == "fully_shard":
        return []
    return [getattr(p, "to_local", lambda p=p: p)().detach() for p in model.parameters()
            if not (mode == "MoE, expert parallel (grouped)" and is_expert_param(p))]


def unsharded_in_step(model, opt, batch, after):
    """One step of a ``fully_shard`` model with a forward pre-hook on every ``nn.Linear``: layer -> bytes of the
    parameters its forward really sees (FSDP2 all-gathers them whole just before, and frees them after)."""
    seen = {}

    def hook(mod, _args, name):
        seen[name] = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))

    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=n: hook(mod, args, n))
             for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    cost_step(model, opt, batch, after)
    for h in hooks:
        h.remove()
    return seen


def dp_costs(d=8, h=16, rows=32, tokens=8, rounds=5, steps=5, warmup=2, modes=COST_MODES, pad=4096):
    """Worker: every mode of ``modes`` built once, trained with Adam; then ``rounds`` rounds, each running
    ``steps`` steps of every mode (the order rotated per round). Per mode: memory per rank (after a step), bytes
    this rank sent per step (``labutils.wire``: the kernel's TCP counters, below every Python API), every step's
    time and the median of each round, the ring minimum, and after the rounds the largest gap between ranks of
    the parameters the mode replicates (``"replica_gap"``). ``"timed_s"``: the rounds' wall-clock, read by a clock
    outside the step timer. ``"unsharded"``: fully_shard's full-size parameters seen in the step, per layer.
    ``"control"``: one step of the first mode with an extra all-reduce of ``pad`` float32 zeros, which the byte
    count must see."""
    from labutils.wire import count_wire

    world = dist.get_world_size()
    built = {m: cost_setup(m, d, h, rows, tokens) for m in modes}
    out: dict = {"world": world, "threads": torch.get_num_threads(), "memory": {}, "sent": {m: [] for m in modes},
                 "round_ms": {m: [] for m in modes}, "step_ms": {m: [] for m in modes}}
    for m, (model, opt, batch, after) in built.items():
        for _ in range(warmup):  # DDP rebuilds its buckets after the first step; Adam allocates its state
            cost_step(model, opt, batch, after)
        out["memory"][m] = memory_per_rank(model, opt)
        out.setdefault("minimum", {})[m] = ring_minimum(m, out["memory"][m], world)
    if "fully_shard" in built:
        out["unsharded"] = unsharded_in_step(*built["fully_shard"])
    start = time.monotonic()
    for r in range(rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            times = []
            for _ in range(steps):
                dist.barrier()
                with count_wire() as wire:
                    t0 = time.perf_counter()
                    cost_step(*built[m])
                    times.append(time.perf_counter() - t0)
                out["sent"][m].append(wire.sent)
            out["step_ms"][m] += [1e3 * t for t in times]
            out["round_ms"][m].append(1e3 * statistics.median(times))
    out["timed_s"] = time.monotonic() - start
    out["replica_gap"] = {m: replica_gap(replicated_params(m, built[m][0]), dist.group.WORLD) for m in modes
                          if m != "fully_shard"}
    model, opt, batch, after = built[modes[0]]
    dist.barrier()
    with count_wire() as plain:
        cost_step(model, opt, batch, after)
    dist.barrier()
    with count_wire() as padded:
        cost_step(model, opt, batch, after)
        dist.all_reduce(torch.zeros(pad))  # an extra exchange nobody asked for
    out["control"] = {"mode": modes[0], "plain": plain.sent, "padded": padded.sent,
                      "pad_minimum": 2 * (world - 1) * pad * 4 / world}
    out["collectives"] = collective_bytes(pad)
    return out


def collective_bytes(numel=4096):
    """Bytes this rank sends for one all-reduce, all-gather and reduce-scatter of a ``numel``-float32 tensor (the
    whole tensor, as FSDP sees a layer's parameter), counted on the wire, next to a ring algorithm's minimum."""
    from labutils.wire import count_wire

    world = dist.get_world_size()
    numel -= numel % world
    calls = {"all_reduce": (lambda: dist.all_reduce(torch.zeros(numel)), 2 * (world - 1) / world),
             "all_gather": (lambda: dist.all_gather_single(torch.empty(numel), torch.zeros(numel // world)),
                            (world - 1) / world),
             "reduce_scatter": (lambda: dist.reduce_scatter_single(torch.empty(numel // world), torch.zeros(numel)),
                                (world - 1) / world)}
    out: dict = {"tensor bytes": numel * 4}
    for name, (call, share) in calls.items():
        dist.barrier()
        with count_wire() as wire:
            call()
        out[name] = {"sent": wire.sent, "ring minimum": share * numel * 4}
    return out
