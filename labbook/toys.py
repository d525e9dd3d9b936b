"""Small models and worker functions the chapters show and the tests import. (Taught in chapters 02 and 07.)

A chapter prints them with ``labutils.show_source(obj)`` and runs them; the tests import the same code, so
there is one copy. A *worker* runs on every rank of ``labutils.launch(fn, world_size, ...)``: these are
module-level functions, which cloudpickle ships by reference (the worker imports ``labbook.toys``).

Chapter 07, data parallelism on gloo workers:

* section 2: ``Net``, ``step_model``, ``train_side_by_side``; worker ``ddp_run``;
* section 3: ``replicate_each_layer`` and the parts of worker ``replicate_checks``;
* section 4: ``SimpleMLP``, ``BatchDim1``, ``train_step``, ``FSDP_CASES`` and the parts of worker ``fsdp_vs_ddp``;
* section 5: ``Expert``, ``TinyMoE``, ``ep_copy`` and the parts of worker ``moe_checks``; workers
  ``moe_ep_groups`` and ``lab_fmoe_check``.

Chapter 02, DeepSpeed (imported inside the functions only): ``expert``, ``distinct_experts``; workers
``ep_parity`` (``ep_size=2`` vs ``ep_size=1``) and ``capacity_pitfall`` (the capacity guard).
"""
from __future__ import annotations

import math
import statistics
import time
from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labutils.collectives import all_to_all
from labutils.compare import compare_models
from labutils.data_parallel import GroupedDataParallel, grad_group, is_expert_param, mark_expert_params

RTOL, ATOL = 1.3e-6, 5e-5  # the tolerance of PyTorch's replicate tests


# ------------------------------------------------------------------ chapter 07, section 2: DDP vs local model
class Net(nn.Module):
    """The 3-layer net of PyTorch's replicate tests."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):  # (B, 2) -> (B, 2)
        return self.fc3(self.fc2(self.fc1(x)))


def step_model(model, x, target):
    """One SGD step with learning rate 1 on the mean-squared error."""
    model.train()
    F.mse_loss(model(x), target).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
            p.grad = None


def batch_rows(n, rank, world):
    """This rank's contiguous share of a global batch of ``n`` rows, ``n`` a multiple of ``world``: a slice."""
    if n % world:
        raise ValueError(f"batch_rows: n={n} rows do not split equally over world={world} ranks; the parity runs "
                         "need equal slices (a mean loss over unequal slices is not the global mean)")
    return slice(rank * n // world, (rank + 1) * n // world)


def plain_params(model):
    """name -> parameter as a plain tensor (a sharded or replicated ``DTensor`` gathered whole), detached."""
    return {n: getattr(p, "full_tensor", lambda p=p: p)().detach() for n, p in model.named_parameters()}


def train_side_by_side(wrap, local_batch=2, iterations=2, rtol=RTOL, atol=ATOL, rows=None):
    """Local model on the global batch vs ``wrap(copy)`` on this rank's rows (``rows(n, rank, world)``, default
    :func:`batch_rows`). Returns ``{"reports": a ParityReport per step, "seen": per step, the input each rank's copy
    really received (a forward pre-hook, all-gathered: a list over ranks), "batches": each step's global batch}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = rows or batch_rows  # looked up at call time: a test can patch toys.batch_rows
    torch.manual_seed(0)  # same model and same global batch on every rank
    local = Net()
    dp = wrap(deepcopy(local))
    received = []
    dp.register_forward_pre_hook(lambda _mod, args: received.append(args[0].detach().clone()))
    n = world * local_batch
    x, target = torch.randn(n, 2), torch.randn(n, 2)  # (W*B, 2)
    out: dict = {"reports": [], "seen": [], "batches": []}
    for it in range(iterations):
        step_model(local, x, target)
        mine = rows(n, rank, world)
        step_model(dp, x[mine], target[mine])
        out["reports"].append(compare_models(plain_params(dp), local, "params", rtol=rtol, atol=atol))
        every = [None] * world
        dist.all_gather_object(every, received.pop())
        out["seen"].append(every)
        out["batches"].append(x)
        torch.manual_seed(it)
        perm = torch.randperm(n)  # reshuffle the examples (input and target together) for the next step
        x, target = x[perm], target[perm]
    return out


def slices_partition(out):
    """(ok, detail): at every step the inputs the ranks' copies received, concatenated in rank order, are the global
    batch exactly (every row on one rank, none twice, none dropped). Observed, not assumed: see train_side_by_side."""
    for step, (every, batch) in enumerate(zip(out["seen"], out["batches"])):
        got = torch.cat(every)
        if got.shape != batch.shape or not torch.equal(got, batch):
            return False, (f"step {step}: the ranks received {[s.shape[0] for s in every]} rows; concatenated they "
                           f"are not the global batch of {batch.shape[0]} rows")
    sizes = [s.shape[0] for s in out["seen"][0]]
    return True, f"{len(out['batches'])} steps; each rank received {sizes} rows, together the global batch"


def ddp_run(local_batch=2):
    """Worker: ``DistributedDataParallel`` against the local model (see train_side_by_side for the result)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return train_side_by_side(lambda m: DDP(m), local_batch)


def ddp_controls(local_batch=2):
    """Worker: two wrong set-ups. ``"no all-reduce"``: each rank trains a plain copy on its slice (no gradient
    average); ``"whole batch"``: DDP, but every rank trains on the whole global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return {"no all-reduce": train_side_by_side(lambda m: m, local_batch),
            "whole batch": train_side_by_side(lambda m: DDP(m), local_batch, rows=lambda n, rank, world: slice(0, n))}


def data_parallel_checks(run):
    """Section 2's checks of one ``train_side_by_side`` result: ``[(what, ok, detail)]``. Parity alone cannot tell a
    data-parallel run from whole-batch training on every rank; the slices check can."""
    bad = [r for r in run["reports"] if not r.ok]
    return [("parameters == local model's after every step", not bad, bad[0].table() if bad else ""),
            ("the ranks trained on disjoint slices that make up the global batch", *slices_partition(run))]


# ------------------------------------------------------------------ chapter 07, section 3: replicate()
def replicate_each_layer(model):
    from torch.distributed._composable.replicate import replicate

    for layer in (model.fc1, model.fc2, model.fc3):
        replicate(layer)
    return model


def replicate_state_dicts():
    """The state_dict keys of the local model, of replicate() and of the DDP wrapper; the values compared."""
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Net()
    whole, parts = replicate(deepcopy(model)), replicate_each_layer(deepcopy(model))
    return {"keys": {"local": list(model.state_dict()), "replicate": list(whole.state_dict()),
                     "DDP wrapper": list(DDP(deepcopy(model)).state_dict())},
            "sd_whole": compare_models(whole, model, "state_dict", rtol=0, atol=0),
            "sd_parts": compare_models(parts, model, "state_dict", rtol=0, atol=0)}


def replicate_fsdp2(model):
    """torch 2.13's FSDP2-based ``replicate`` (private: ``torch.distributed._composable.replicate_with_fsdp``) on a
    CPU mesh: every parameter becomes a ``Replicate()`` DTensor, gradients are all-reduced by FSDP2's machinery."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    return replicate(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def replicate_trains(local_batch):
    """replicate() on the whole model, on each layer, with DDP's options, and the FSDP2-based replicate: a
    train_side_by_side result each."""
    from torch.distributed._composable.replicate import replicate

    return {"train_whole": train_side_by_side(lambda m: replicate(m), local_batch),
            "train_parts": train_side_by_side(replicate_each_layer, local_batch),
            "train_kwargs": train_side_by_side(
                lambda m: replicate(m, bucket_cap_mb=1, gradient_as_bucket_view=True), local_batch),
            "train_fsdp2": train_side_by_side(replicate_fsdp2, local_batch)}


def replicate_ignored_fc1():
    """replicate(ignored_modules=[fc1]): max |grad(rank 1) - grad(rank 0)| per layer, and its device_ids."""
    from torch.distributed._composable.replicate import replicate

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different weights AND inputs per rank
    ign = Net()
    replicate(ign, ignored_modules=[ign.fc1])  # fc1's gradient stays local, fc2/fc3 are averaged
    inp = torch.randn(5, 2) * (rank + 1)  # (B, 2)
    (ign(inp) * 10).sum().backward()
    grads = {}
    for name in ("fc1", "fc2", "fc3"):
        g = getattr(ign, name).weight.grad
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g)
        grads[name] = (every[1] - every[0]).abs().max().item()
    return {"ignored_grad_diff": grads, **replicate_device_ids()}


def replicate_device_ids():
    """The DDP instance behind ``replicate()`` on CPU (default and ``device_id=torch.device("cpu")``): is it alive,
    and what are its ``device_ids``? A dead weak reference is reported as such, never as ``device_ids=None``."""
    from torch.distributed._composable.replicate import replicate

    out = {}
    for label, device_id in (("default", None), ("device_id=cpu", torch.device("cpu"))):
        m = Net()
        replicate(m) if device_id is None else replicate(m, device_id=device_id)
        m(torch.randn(2, 2))  # the DDP instance is built lazily, at the first forward
        ddp = replicate.state(m)._ddp_weakref()  # private API: a weak reference to the DDP behind the hooks
        out[label] = {"alive": ddp is not None, "device_ids": None if ddp is None else ddp.device_ids,
                      "param devices": sorted({p.device.type for p in m.parameters()})}
    return {"device_ids": out}


def replicate_device_id_error():
    """What ``replicate(model, device_id=<a list>)`` does, observed: ``{"raised": the exception's type name (None if
    none), "message", "retry": what a second, valid ``replicate(model)`` on the same model then does ("trains" or
    the exception's type and first line)}``."""
    from torch.distributed._composable.replicate import replicate

    m = Net()
    raised = message = None
    try:
        replicate(m, device_id=[torch.device("cpu")])
    except Exception as exc:  # noqa: BLE001  (the type is what we report)
        raised, message = type(exc).__name__, str(exc)
    try:
        replicate(m)
        m(torch.randn(2, 2)).sum().backward()
        retry = "trains"
    except Exception as exc:  # noqa: BLE001
        retry = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return {"raised": raised, "message": message, "retry": retry}


def replicate_checks(local_batch=2):
    """Worker: the checks of PyTorch's test_replicate.py that apply to CPU, in one dict."""
    return {**replicate_state_dicts(), **replicate_trains(local_batch), **replicate_ignored_fc1(),
            "device_id_error": replicate_device_id_error()}


# ------------------------------------------------------------------ chapter 07, section 4: fully_shard vs DDP
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
        dist.reduce_scatter_tensor(out, mine)
        total = world * (world + 1) / 2
        assert out.dtype == torch.bfloat16 and bool((out == total).all()), out
        gathered = torch.empty(2 * world, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), dtype=torch.bfloat16))
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
    rows["init_device_mesh('cuda', ...)"] = (_try(cuda_mesh) if torch.cuda.is_available()
                                             else ("skipped", "no CUDA device on this machine"))
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


# ------------------------------------------------------------------ chapter 07, section 5: MoE under data parallel
class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):  # (T, d) -> (T, d)
        return self.w2(torch.relu(self.w1(x)))


class TinyMoE(nn.Module):
    """dense -> top-1 gate -> experts -> dense. ``keep_expert(e, group)`` turns it expert parallel."""

    def __init__(self, d=8, h=16, num_experts=2):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(d, d), nn.Linear(d, num_experts), nn.Linear(d, d)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))
        self.ep_group = None

    def keep_expert(self, e, ep_group):
        """Keep only expert ``e`` (this rank's), serve the tokens of every rank in ``ep_group``."""
        self.experts, self.ep_group = nn.ModuleList([self.experts[e]]), ep_group
        return self

    def forward(self, x):  # (T, d) -> (T, d)
        h = self.inp(x)
        score, idx = F.softmax(self.gate(h), dim=-1).max(dim=-1)  # (T,), (T,)
        y = self.all_experts(h, idx) if self.ep_group is None else self.expert_parallel(h, idx)
        return self.out(h + score[:, None] * y)

    def all_experts(self, h, idx):
        every = torch.stack([e(h) for e in self.experts], dim=1)  # (T, E, d)
        return every[torch.arange(h.shape[0]), idx]  # (T, d)

    def expert_parallel(self, h, idx):
        order = idx.argsort(stable=True)  # tokens grouped by expert = by destination rank
        send = torch.bincount(idx, minlength=dist.get_world_size(self.ep_group))  # (E,)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)  # how many tokens each rank sends me
        mine = all_to_all(h[order], recv.tolist(), send.tolist(), group=self.ep_group, check=False)  # (sum recv, d)
        back = all_to_all(self.experts[0](mine), send.tolist(), recv.tolist(), group=self.ep_group,
                          check=False)  # sizes already exchanged above
        return back[order.argsort()]  # (T, d), original token order


def ep_copy(ref, e, ep_group):
    """The expert-parallel copy of ``ref`` for the rank that owns expert ``e``, expert params tagged."""
    m = deepcopy(ref).keep_expert(e, ep_group)
    m.zero_grad(set_to_none=True)
    mark_expert_params(m.experts)
    return m


def as_rank_names(ref, e, what="grads"):
    """The reference's gradients (or parameters) as the rank owning expert ``e`` names them: its experts.0."""
    own = f"experts.{e}."
    return {k.replace(own, "experts.0."): (p.grad.clone() if what == "grads" else p.detach())
            for k, p in ref.named_parameters() if not k.startswith("experts.") or k.startswith(own)}


def moe_setup(d, h, tokens, num_experts, e):
    """The single-process reference (all experts, one backward on the global batch, the same on every rank),
    this rank's tokens and targets, and the reference's gradients for the rank owning expert ``e``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same reference model and global batch everywhere
    ref = TinyMoE(d, h, num_experts=num_experts)
    x, target = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
    F.mse_loss(ref(x), target).backward()
    mine = slice(rank * tokens, (rank + 1) * tokens)
    return ref, x[mine], target[mine], as_rank_names(ref, e)


def grads_of(model):
    """name -> gradient, without DDP's ``module.`` prefix; a sharded (DTensor) gradient gathered whole."""
    return {k.removeprefix("module."): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
            for k, p in model.named_parameters()}


def norm_rel(got, want):
    """name -> ||got - want|| / ||want|| per tensor (Frobenius norms): a relative error that near-zero entries
    cannot blow up (an elementwise max-rel divides by them)."""
    return {k: ((got[k].detach().double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
            for k, w in want.items() if k in got and got[k] is not None}


def moe_naive_ddp(ref, x, target, want):
    """Plain DDP on the expert-parallel model, with its start-up broadcast and without (init_sync=False)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    m = ep_copy(ref, rank, dist.group.WORLD)
    naive = DDP(m)  # broadcasts rank 0's parameters, experts.0 included
    out = {"naive_expert_overwritten": (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()}
    F.mse_loss(naive(x), target).backward()
    out["naive DDP"] = compare_models(grads_of(m), want, "grads")
    out["naive DDP rel"] = norm_rel(grads_of(m), want)
    m = ep_copy(ref, rank, dist.group.WORLD)
    no_sync = DDP(m, init_sync=False)  # kept referenced: a DDP collected before backward reduces nothing
    F.mse_loss(no_sync(x), target).backward()
    out["DDP init_sync=False"] = compare_models(grads_of(m), want, "grads")
    out["DDP init_sync=False rel"] = norm_rel(grads_of(m), want)
    return out


def moe_grouped(ref, x, target, want):
    """labutils' GroupedDataParallel, with DeepSpeed's expert scale (the default) and fastmoe's ("sum")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = ep_copy(ref, rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m)
    out = {"grouped_expert_overwritten": (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()}
    F.mse_loss(gdp(x), target).backward()
    out["counts"] = gdp.allreduce_gradients()
    out["grouped"] = compare_models(grads_of(m), want, "grads")
    out["grouped rel"] = norm_rel(grads_of(m), want)
    # fastmoe's scale: expert grads are the SUM over ranks = world x the reference
    m = ep_copy(ref, rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m, expert_scale="sum")
    F.mse_loss(gdp(x), target).backward()
    gdp.allreduce_gradients()
    out["sum_scale"] = compare_models({k: g / world if k.startswith("experts.") else g for k, g in grads_of(m).items()},
                                      want, "grads")
    return out


def moe_native(ref, x, target, want):
    """PyTorch's replicate() / fully_shard() for the dense parameters; expert grads divided by the world by hand."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    m = ep_copy(ref, rank, dist.group.WORLD)
    replicate(m, ignored_modules=[m.experts])
    F.mse_loss(m(x), target).backward()
    for p in m.experts.parameters():
        p.grad /= world  # DeepSpeed's scale
    out["replicate(ignored_modules=experts)"] = compare_models(grads_of(m), want, "grads")
    out["is_expert"] = {k: is_expert_param(p) for k, p in m.named_parameters()}
    # FSDP2: shard the dense parameters only, the experts stay plain local tensors
    m = ep_copy(ref, rank, dist.group.WORLD)
    fully_shard(m, ignored_params=set(m.experts.parameters()))
    F.mse_loss(m(x), target).backward()
    for p in m.experts.parameters():
        p.grad /= world
    out["fsdp_types"] = sorted({f"{k.split('.')[0]}: {type(p).__name__}" for k, p in m.named_parameters()})
    out["fully_shard(ignored_params=experts)"] = compare_models(grads_of(m), want, "grads")
    return out


def moe_train_parity(d, h, tokens, steps, lr=0.5):
    """SGD steps of the grouped expert-parallel model vs the reference, a new global batch each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyMoE(d, h, num_experts=world)
    m = GroupedDataParallel(ep_copy(ref, rank, dist.group.WORLD))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(m.parameters(), lr=lr)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    out = {"train": [], "losses": []}
    for step in range(steps):
        torch.manual_seed(1000 + step)
        xs, ts = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref = F.mse_loss(ref(xs), ts)
        loss_ref.backward()
        F.mse_loss(m(xs[mine]), ts[mine]).backward()
        m.allreduce_gradients()
        opt_ref.step()
        opt.step()
        want = as_rank_names(ref, rank, "params")
        out["train"].append(compare_models(m.module, want, "params", rtol=RTOL, atol=ATOL))
        out["losses"].append(loss_ref.item())
    return out


def moe_checks(d=8, h=16, tokens=8, steps=2):
    """Worker: rank r owns expert r; every method's gradients vs the reference's, then the training parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, x, target, want = moe_setup(d, h, tokens, num_experts=world, e=rank)
    return {**moe_naive_ddp(ref, x, target, want), **moe_grouped(ref, x, target, want),
            **moe_native(ref, x, target, want), **moe_train_parity(d, h, tokens, steps)}


def replica_gap(params, group):
    """max |p - p on the group's first rank| over ``params``, observed by an all-gather (not the broadcast under
    test); the same number on every rank (a MAX all-reduce over the world)."""
    gap = torch.zeros(())
    for p in params:
        every = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, p.detach().contiguous(), group=group)
        gap = torch.maximum(gap, max((e - every[0]).abs().max() for e in every))
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def moe_ep_groups(d, h, tokens, ep_size, replica_offset=0.0, layout=False, sync=True):
    """Worker: expert-parallel groups of ``ep_size`` ranks, each expert replicated over an expert-data-parallel
    group; the grouped gradients vs the reference's. ``replica_offset`` is added to every parameter (dense and
    expert) of the ranks outside the first group before the wrap, whose start-up broadcast must make them equal
    again (``sync=False`` skips it: a negative control). ``layout=True`` also returns the groups' ranks, how many
    gradient tensors each reduction carried (what chapter 07 draws) and the largest gap between replicas before
    and after the wrap (``"gap"``: dense over every rank, experts over their expert-data-parallel group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_ranks = [list(range(g, g + ep_size)) for g in range(0, world, ep_size)]   # hold different experts
    edp_ranks = [list(range(e, world, ep_size)) for e in range(ep_size)]          # hold the same expert
    ep_groups, edp_groups = [dist.new_group(r) for r in ep_ranks], [dist.new_group(r) for r in edp_ranks]
    e = rank % ep_size
    ref, x, target, want = moe_setup(d, h, tokens, num_experts=ep_size, e=e)
    m = ep_copy(ref, e, ep_groups[rank // ep_size])
    if replica_offset and rank >= ep_size:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(replica_offset)
    dense = [p for n, p in m.named_parameters() if not n.startswith("experts.")]

    def gaps():
        return {"dense": replica_gap(dense, dist.group.WORLD),
                "expert": replica_gap(list(m.experts.parameters()), edp_groups[e])}

    before = gaps()
    gdp = GroupedDataParallel(m, expert_dp_group=edp_groups[e], sync_params=sync)
    gap = {"before": before, "after": gaps()}
    F.mse_loss(gdp(x), target).backward()
    counts = gdp.allreduce_gradients()
    report = compare_models(m, want, "grads")
    if not layout:
        return report
    return report, {"ep": ep_ranks, "edp": edp_ranks, "counts": counts, "gap": gap,
                    "names": {n: grad_group(p) for n, p in m.named_parameters()}}


def broadcast_checks(ep_out, offset):
    """Chapter 07's checks of the start-up broadcast on ``moe_ep_groups(..., replica_offset=offset, layout=True)``'s
    results: ``[(what, ok, detail)]``. They fail when the broadcast does nothing."""
    gap = ep_out[0][1]["gap"]
    before = min(gap["before"].values())
    after = max(gap["after"].values())
    bad = [rep for rep, _ in ep_out if not rep.ok]
    return [(f"the replicas start different (gap before the wrap: dense {gap['before']['dense']:.3g}, "
             f"experts {gap['before']['expert']:.3g})", before >= 0.99 * offset, str(gap)),
            (f"the wrap's broadcast makes them equal (gap after: dense {gap['after']['dense']:.3g}, "
             f"experts {gap['after']['expert']:.3g})", after == 0.0, str(gap)),
            ("grouped gradients == reference on every rank", not bad, bad[0].table() if bad else "")]


def fmoe_block(d, h, world_size, num_expert):
    """dense -> the lab's FMoETransformerMLP (top-2) -> dense."""
    from labutils.moe import FMoETransformerMLP

    moe = FMoETransformerMLP(num_expert=num_expert, d_model=d, d_hidden=h, world_size=world_size, top_k=2)
    return nn.Sequential(nn.Linear(d, d), moe, nn.Linear(d, d))


def lab_fmoe_check(d=8, h=16, tokens=8, num_expert=2):
    """Worker: FMoETransformerMLP(world_size=W) + GroupedDataParallel vs the world_size=1 layer holding all
    ``W * num_expert`` experts: (gradient report, dp_comm tags, gradient tensors per group)."""
    from labutils.moe.expert_parallel import shard_state

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = fmoe_block(d, h, 1, world * num_expert)
    x, target = torch.randn(world * tokens, d), torch.randn(world * tokens, d)  # (W*T, d)
    F.mse_loss(ref(x), target).backward()
    m = fmoe_block(d, h, world, num_expert)
    m.load_state_dict(shard_state(ref.state_dict(), rank, num_expert))
    gdp = GroupedDataParallel(m)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    F.mse_loss(gdp(x[mine]), target[mine]).backward()
    counts = gdp.allreduce_gradients()
    tags = {n: getattr(p, "dp_comm", "dp (untagged)") for n, p in m.named_parameters()}
    want = shard_state({n: p.grad for n, p in ref.named_parameters()}, rank, num_expert)
    return compare_models(m, want, "grads"), tags, counts


# ------------------------------------------------------------------ chapter 07, section 6: what each choice costs
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


def dp_costs(d=8, h=16, rows=32, tokens=8, rounds=5, steps=5, warmup=2, modes=COST_MODES, pad=4096):
    """Worker: every mode of ``modes`` built once, trained with Adam; then ``rounds`` rounds, each running
    ``steps`` steps of every mode (the order rotated per round). Per mode: memory per rank (after a step), bytes
    this rank sent per step (``labutils.wire``: the kernel's TCP counters, below every Python API), the median
    step time of each round, the ring minimum. ``"control"``: one DDP step with an extra all-reduce of ``pad``
    float32 zeros, which the byte count must see."""
    from labutils.wire import count_wire

    world = dist.get_world_size()
    built = {m: cost_setup(m, d, h, rows, tokens) for m in modes}
    out: dict = {"world": world, "threads": torch.get_num_threads(), "memory": {}, "sent": {m: [] for m in modes},
                 "round_ms": {m: [] for m in modes}}
    for m, (model, opt, batch, after) in built.items():
        for _ in range(warmup):  # DDP rebuilds its buckets after the first step; Adam allocates its state
            cost_step(model, opt, batch, after)
        out["memory"][m] = memory_per_rank(model, opt)
        out.setdefault("minimum", {})[m] = ring_minimum(m, out["memory"][m], world)
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
            out["round_ms"][m].append(1e3 * statistics.median(times))
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
             "all_gather": (lambda: dist.all_gather_into_tensor(torch.empty(numel), torch.zeros(numel // world)),
                            (world - 1) / world),
             "reduce_scatter": (lambda: dist.reduce_scatter_tensor(torch.empty(numel // world), torch.zeros(numel)),
                                (world - 1) / world)}
    out: dict = {"tensor bytes": numel * 4}
    for name, (call, share) in calls.items():
        dist.barrier()
        with count_wire() as wire:
            call()
        out[name] = {"sent": wire.sent, "ring minimum": share * numel * 4}
    return out


# ------------------------------------------------------------------ chapter 02: DeepSpeed MoE
def expert(d):
    """The expert every MoE layer in chapter 02 copies: a 2-layer MLP."""
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


def distinct_experts(moe, seed=0):
    """Re-initialise every expert differently (DeepSpeed starts them identical), so routing matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return moe


def ep_layers(d, num_experts, k, seed=0, **moe_kwargs):
    """This rank's ``ep_size=1`` layer (all experts, made distinct) and the ``ep_size=W`` layer holding its share.
    ``moe_kwargs`` override DeepSpeed ``MoE`` arguments (``capacity_factor``, ``drop_tokens``, ...)."""
    from labutils.ds.runtime import init_deepspeed, quiet, shard_for_rank

    init_deepspeed()  # adopts the gloo group launch created
    from deepspeed.moe.layer import MoE

    def build(ep_size):
        torch.manual_seed(seed)
        kwargs = dict(capacity_factor=1.0, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
        return MoE(d, expert(d), num_experts=num_experts, ep_size=ep_size, k=k, **{**kwargs, **moe_kwargs})

    full, sharded = distinct_experts(build(1), seed), build(dist.get_world_size())
    with quiet():
        sharded.set_deepspeed_parallelism()  # creates the expert-parallel group "ep_size_2"
    sharded.load_state_dict(shard_for_rank(full.state_dict(), sharded, dist.get_rank()))
    return full, sharded


def ep_parity(d, num_experts, k, tokens, seed=0):
    """Worker: both layers on this rank's tokens: their outputs, and their gradients as ``ep_size=W`` names them."""
    from labutils.ds.runtime import shard_for_rank

    rank = dist.get_rank()
    full, sharded = ep_layers(d, num_experts, k, seed)
    torch.manual_seed(seed + 1 + rank)  # every rank has its own tokens
    x, target = torch.randn(tokens, d), torch.randn(tokens, d)  # (S, d)
    outs = {}
    for name, model in (("ep1", full), ("ep2", sharded)):
        y, l_aux, _ = model(x)
        (((y - target) ** 2).mean() + 0.01 * l_aux).backward()
        outs[name] = y.detach()
    grads1 = {n: p.grad.clone() for n, p in full.named_parameters() if p.grad is not None}
    for n, g in grads1.items():
        if "deepspeed_experts" in n:
            dist.all_reduce(g)  # ep_size=1: each rank saw only its tokens
    return {"out": outs, "grads_ep1": shard_for_rank(grads1, sharded, rank),
            "grads_ep2": {n: p.grad for n, p in sharded.named_parameters()}}


def capacity_pitfall(d, num_experts, guard, fix):
    """Worker: ranks whose capacities differ (``drop_tokens=False``), with or without the guard and the expert
    group (``fix``): "CapacityMismatchError: ..." or "ran: ..."."""
    from labutils.ds.runtime import CapacityMismatchError, init_deepspeed, install_capacity_guard, quiet

    init_deepspeed()
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(d, expert(d), num_experts=num_experts, ep_size=2, k=1, drop_tokens=False, use_rts=False)
    if fix:
        with quiet():
            moe.set_deepspeed_parallelism()
    if guard:
        install_capacity_guard(moe)
    torch.manual_seed(1)  # rank 1's tokens all look alike: one expert gets all of them
    x = torch.randn(16, d) if dist.get_rank() == 0 else torch.randn(1, d) + 0.01 * torch.randn(16, d)  # (S, d)
    try:
        _, _, counts = moe(x)
    except CapacityMismatchError as exc:
        return f"CapacityMismatchError: {exc}"
    return f"ran: local max load {int(counts.max())}"
