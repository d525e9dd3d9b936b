"""Chapter 07, section 4: ``fully_shard`` (FSDP2) against DDP on a CPU device mesh. (Taught in chapter 07.)

``SimpleMLP``, ``BatchDim1``, ``train_step``, ``FSDP_CASES`` and the parts of worker ``fsdp_vs_ddp``, with the
feature rows of ``gloo_features``.
"""
from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labbook.toys.ch07_ddp import ATOL, RTOL
from labutils.compare import compare_models
from labutils.launcher.backend import gpu_or_cpu


class SimpleMLP(nn.Module):
    """The MLP of PyTorch's data-parallel tests: 50 -> 32 -> 8."""

    def __init__(self):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(50, 32), nn.ReLU(), nn.Linear(32, 8)

    def forward(self, x):  # (B, 50) -> (B, 8)
        return torch.sigmoid(self.net2(self.relu(self.net1(x))))


class BatchDim1(nn.Module):
    """Takes (50, B) and returns (8, B): the batch is dimension 1."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x):  # (50, B) -> (8, B)
        return self.mlp(x.t().contiguous()).t().contiguous()  # a view output would trip FSDP2's hook warning


def train_step(model, opt, batch):
    opt.zero_grad()
    inputs, labels = batch
    loss = (model(inputs) - labels).sum()
    loss.backward()
    opt.step()
    return loss.detach()


FSDP_CASES = {  # name -> (model class, optimizer class, options, batch dim)
    "SGD": (SimpleMLP, "SGD", dict(lr=0.1), 0),
    "SGD momentum": (SimpleMLP, "SGD", dict(lr=0.1, momentum=0.9), 0),
    "SGD momentum foreach": (SimpleMLP, "SGD", dict(lr=0.1, momentum=0.9, foreach=True), 0),
    "Adam": (SimpleMLP, "Adam", dict(lr=0.1), 0),
    "Adam fused": (SimpleMLP, "Adam", dict(lr=0.1, fused=True), 0),
    "batch dim 1, Adam fused": (BatchDim1, "Adam", dict(lr=0.1, fused=True), 1),
}


def shard_each_linear(model, mesh):
    """fully_shard every nn.Linear of ``model``, then the model itself."""
    from torch.distributed.fsdp import fully_shard

    for layer in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(layer, mesh=mesh)  # one all-gather group per layer ...
    fully_shard(model, mesh=mesh)  # ... and the root
    return model


def fsdp_case(cls, opt_name, opts, batch_dim, rows, mesh, steps=2):
    """DDP and fully_shard copies of ``cls()`` train on this rank's batch: (a report per step, the FSDP model)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    mod = cls()
    ddp, fsdp = DDP(deepcopy(mod)), shard_each_linear(deepcopy(mod), mesh)
    opt_d = getattr(torch.optim, opt_name)(ddp.parameters(), **opts)
    opt_f = getattr(torch.optim, opt_name)(fsdp.parameters(), **opts)
    torch.manual_seed(100 + dist.get_rank())  # every rank its own batch
    x, y = torch.randn(rows, 50), torch.randn(rows, 8)  # (B, 50), (B, 8)
    batch = (x, y) if batch_dim == 0 else (x.t().contiguous(), y.t().contiguous())
    reports = []
    for _ in range(steps):
        train_step(ddp, opt_d, batch)
        train_step(fsdp, opt_f, batch)
        gathered = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
        reports.append(compare_models(gathered, ddp, "params", rtol=RTOL, atol=ATOL))
    return reports, fsdp


def shard_table(model):
    """name -> (type, global shape, this rank's shape, placements) for every parameter of a sharded model."""
    return {n: (type(p).__name__, tuple(p.shape), tuple(p.to_local().shape), str(p.placements))
            for n, p in model.named_parameters()}


def cpu_offload_error(mesh):
    """The error of ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (None if it works)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    try:  # CPU offload of the sharded parameters wants an accelerator to copy them to
        fully_shard(SimpleMLP(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def solo_mesh():
    """A wrong mesh on purpose: every rank alone in its own 1-rank CPU mesh (fully_shard then shards over nobody
    and averages with nobody). Every rank must call it (each group is created on every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = groups[dist.get_rank()]
    assert isinstance(mine, dist.ProcessGroup), mine  # this rank is a member of its own group
    return DeviceMesh.from_group(mine, "cpu")


def _try(fn):
    """("works", detail) when ``fn()`` returns detail, ("fails", "Type: message") when it raises."""
    try:
        return "works", fn()
    except Exception as exc:  # noqa: BLE001  (the row reports whatever failed)
        return "fails", f"{type(exc).__name__}: {str(exc)[:160]}"


def gloo_features(mesh):
    """Each FSDP2 feature row of chapter 07's table, run on this CPU/gloo world: name -> (status, what was seen).
    A row whose result is wrong raises AssertionError inside ``_try`` and is reported as "fails"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()

    def uneven():
        torch.manual_seed(0)
        lin = nn.Linear(3, 2 * world + 1)  # 2W+1 output rows over W ranks: unequal shards
        whole = lin.weight.detach().clone()
        fully_shard(lin, mesh=mesh)
        shard: Any = lin.weight  # a DTensor now
        sizes: list = [None] * world
        dist.all_gather_object(sizes, shard.to_local().shape[0])
        assert sum(sizes) == whole.shape[0] and len(set(sizes)) > 1, sizes
        assert torch.equal(shard.full_tensor(), whole)
        return f"rows per rank {sizes} of {whole.shape[0]}; full_tensor() == the unsharded weight"

    def bf16_collectives():
        mine = torch.full((2 * world,), float(rank + 1), dtype=torch.bfloat16)
        out = torch.empty(2, dtype=torch.bfloat16)
        dist.reduce_scatter_single(out, mine)
        total = world * (world + 1) / 2
        assert out.dtype == torch.bfloat16 and bool((out == total).all()), out
        gathered = torch.empty(2 * world, dtype=torch.bfloat16)
        dist.all_gather_single(gathered, torch.full((2,), float(rank), dtype=torch.bfloat16))
        assert torch.equal(gathered, torch.arange(world).repeat_interleave(2).to(torch.bfloat16)), gathered
        return f"reduce-scatter sum {total:g}, all-gather of ranks {list(range(world))}, in bfloat16"

    def avg():
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.item() == (world + 1) / 2, t
        return f"AVG of 1..{world} = {t.item():g}"

    def mixed_precision():
        torch.manual_seed(0)
        m: Any = fully_shard(SimpleMLP(), mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        y = m(torch.randn(4, 50))
        y.float().sum().backward()
        kinds = {(str(p.dtype), str(p.grad.dtype)) for p in m.parameters()}
        assert y.dtype == torch.bfloat16 and kinds == {("torch.float32", "torch.float32")}, (y.dtype, kinds)
        return "forward in bfloat16; sharded parameters and their gradients stay float32"

    def cuda_mesh():
        init_device_mesh("cuda", (world,))
        return "built"

    rows = {"init_device_mesh('cpu'), fully_shard(mesh=...), uneven shards": _try(uneven),
            "reduce-scatter / all-gather in bfloat16": _try(bf16_collectives),
            "all_reduce with ReduceOp.AVG": _try(avg),
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16)": _try(mixed_precision)}
    backend, _, why = gpu_or_cpu(world)         # a CUDA mesh of W ranks needs W GPUs, or NCCL's setup waits
    rows["init_device_mesh('cuda', ...)"] = _try(cuda_mesh) if backend == "nccl" else ("skipped", why)
    return rows


def fsdp_vs_ddp(cases=FSDP_CASES, rows=16, steps=2):
    """Worker: every case of ``cases`` (see FSDP_CASES), fully_shard against DDP on a CPU device mesh: a report
    per step, the first case's shards, every case's final (gathered) parameters, the CPU-offload error; the
    negative control (``"control"``: the SGD case sharded on a 1-rank mesh per rank, i.e. no gradient average);
    the feature rows of :func:`gloo_features`."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict = {"reports": {}}
    for name, (cls, opt_name, opts, batch_dim) in cases.items():
        out["reports"][name], fsdp = fsdp_case(cls, opt_name, opts, batch_dim, rows, mesh, steps)
        out.setdefault("final", {})[name] = {n: p.full_tensor().detach() for n, p in fsdp.named_parameters()}
        if "shards" not in out:  # the first case's parameters, as this rank stores them
            out["shards"] = shard_table(fsdp)
    out["offload_error"] = cpu_offload_error(mesh)
    out["control"] = fsdp_case(SimpleMLP, "SGD", dict(lr=0.1), 0, rows, solo_mesh(), steps)[0]
    out["features"] = gloo_features(mesh)
    return out
